//! Pushes to a forge without a token in the sandbox ([`crate::forges`]):
//! on an intercepted connection ([`super::intercept`]), a request for one
//! allowed repository's smart-HTTP endpoints gets the token in place of the
//! placeholder password of its `Authorization: Basic`, and a push
//! (`git-receive-pack`) has its commands read and checked before anything
//! of it reaches the forge: only branches of the allowed patterns (and
//! tags, when allowed), never a deletion.

use base64::Engine as _;

/// Most bytes of commands a push may send before its pack.
pub const COMMANDS_MAX: usize = 1 << 20;

/// Most refs one push may update.
pub const REFS_MAX: usize = 1000;

/// One repository a sandbox may push to, as the gateway applies it.
#[derive(Clone)]
pub struct Rule {
    /// `https://host/owner/repo`, as the person gave it (for logs).
    pub url: String,
    /// The repository's path on the host: `/owner/repo` (no `.git`).
    pub path: String,
    /// The user name sent with the token.
    pub user: String,
    /// The password git sends from inside.
    pub placeholder: String,
    /// The token.
    pub token: String,
    /// Branch patterns (`*` matches anything, `/` included).
    pub branches: Vec<String>,
    /// Tags may be pushed (never deleted).
    pub tags: bool,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("url", &self.url)
            .field("branches", &self.branches)
            .field("tags", &self.tags)
            .finish_non_exhaustive()
    }
}

/// A smart-HTTP endpoint of a repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `GET …/info/refs?service=…` (either service).
    InfoRefs,
    /// `POST …/git-upload-pack` (a fetch).
    UploadPack,
    /// `POST …/git-receive-pack` (a push).
    ReceivePack,
}

/// The endpoint of `rule`'s repository that `method target` is, exactly
/// (no `..`, no escapes, no other query): anything else gets no token.
#[must_use]
pub fn endpoint(method: &str, target: &str, rule: &Rule) -> Option<Endpoint> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let rest = path.strip_prefix(rule.path.as_str())?;
    let rest = rest.strip_prefix(".git").unwrap_or(rest);
    match (method, rest, query) {
        ("GET", "/info/refs", "service=git-upload-pack" | "service=git-receive-pack") => {
            Some(Endpoint::InfoRefs)
        }
        ("POST", "/git-upload-pack", "") => Some(Endpoint::UploadPack),
        ("POST", "/git-receive-pack", "") => Some(Endpoint::ReceivePack),
        _ => None,
    }
}

/// `Authorization` value `value` with the token in place of the
/// placeholder: only `Basic base64(user:placeholder)`, the password exactly
/// the placeholder; `None` for anything else (left as it is).
#[must_use]
pub fn swap_basic(value: &[u8], rule: &Rule) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(value).ok()?.trim();
    let (scheme, b64) = text.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let engine = base64::engine::general_purpose::STANDARD;
    let plain = engine.decode(b64.trim()).ok()?;
    let colon = plain.iter().position(|&b| b == b':')?;
    if &plain[colon + 1..] != rule.placeholder.as_bytes() {
        return None;
    }
    let creds = format!("{}:{}", rule.user, rule.token);
    Some(format!("Basic {}", engine.encode(creds)).into_bytes())
}

/// The forms of the token an answer may carry, to be masked: the token,
/// and the credentials as the `Authorization` header has them.
#[must_use]
pub fn secret_forms(rule: &Rule) -> Vec<Vec<u8>> {
    let engine = base64::engine::general_purpose::STANDARD;
    vec![
        rule.token.as_bytes().to_vec(),
        engine
            .encode(format!("{}:{}", rule.user, rule.token))
            .into_bytes(),
    ]
}

/// One ref a push updates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// Its tip before (zeros: a new ref).
    pub old: String,
    /// Its tip after (zeros: a deletion).
    pub new: String,
    /// The full ref name.
    pub name: String,
}

/// What is not a push's pkt-lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotPktLines;

/// The length of the pkt-lines at the start of `data` up to and with the
/// flush that ends a push's commands, once it is there (reading on from
/// `from`, where the last call stopped: each byte is looked at once);
/// `Err` for what is not a pkt-line.
///
/// # Errors
/// A length that is not four hex digits, or less than 4.
pub fn commands_end(data: &[u8], from: &mut usize) -> Result<Option<usize>, NotPktLines> {
    while let Some(len) = data.get(*from..*from + 4) {
        if !len.iter().all(u8::is_ascii_hexdigit) {
            return Err(NotPktLines);
        }
        let len = usize::from_str_radix(std::str::from_utf8(len).map_err(|_| NotPktLines)?, 16)
            .map_err(|_| NotPktLines)?;
        if len == 0 {
            return Ok(Some(*from + 4));
        }
        if len < 4 || data.len() < *from + len {
            return if len < 4 { Err(NotPktLines) } else { Ok(None) };
        }
        *from += len;
    }
    Ok(None)
}

/// A push's commands and the capabilities its client asked for.
pub type Commands = (Vec<Command>, Vec<String>);

/// The commands at the start of a push's body: `Ok(None)` while more is
/// needed; `Ok(Some((commands, capabilities)))` once the flush that ends
/// them is in `data`.
///
/// # Errors
/// What is not a push this gateway passes on (a signed push, malformed
/// lines, too many refs).
pub fn commands(data: &[u8]) -> Result<Option<Commands>, String> {
    let mut at = 0;
    let mut list = Vec::new();
    let mut caps = Vec::new();
    let mut lines = 0;
    loop {
        lines += 1;
        if lines > 2 * REFS_MAX {
            return Err(format!("a push of more than {} lines", 2 * REFS_MAX));
        }
        let Some(len) = data.get(at..at + 4) else {
            return Ok(None);
        };
        let len = std::str::from_utf8(len)
            .ok()
            .and_then(|h| usize::from_str_radix(h, 16).ok())
            .ok_or("a push whose commands are not pkt-lines")?;
        if len == 0 {
            return Ok(Some((list, caps)));
        }
        if len < 4 {
            return Err("a push whose commands are not pkt-lines".to_owned());
        }
        let Some(line) = data.get(at + 4..at + len) else {
            return Ok(None);
        };
        at += len;
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let (line, more) = match line.iter().position(|&b| b == 0) {
            Some(nul) => (&line[..nul], Some(&line[nul + 1..])),
            None => (line, None),
        };
        if let Some(c) = more {
            let words: Vec<String> = String::from_utf8_lossy(c)
                .split(' ')
                .map(str::to_owned)
                .collect();
            // Push options reach the forge's own handling (GitLab's
            // `merge_request.*`, Gitea's `repo.private`): none is passed on.
            if words
                .iter()
                .any(|w| w.split('=').next() == Some("push-options"))
            {
                return Err("push options (git push -o) are not passed on".to_owned());
            }
            if caps.is_empty() {
                caps = words;
            }
        }
        let text = std::str::from_utf8(line).map_err(|_| "a push command that is not text")?;
        if text.starts_with("shallow ") {
            continue;
        }
        if text.starts_with("push-cert") {
            return Err("signed pushes (--signed) are not passed on".to_owned());
        }
        let mut parts = text.splitn(3, ' ');
        let (Some(old), Some(new), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("a malformed push command".to_owned());
        };
        let oid = |s: &str| matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !oid(old) || !oid(new) {
            return Err("a malformed push command".to_owned());
        }
        list.push(Command {
            old: old.to_owned(),
            new: new.to_owned(),
            name: name.to_owned(),
        });
        if list.len() > REFS_MAX {
            return Err(format!("a push of more than {REFS_MAX} refs"));
        }
    }
}

/// Why `rule` refuses command `c`, if it does.
#[must_use]
pub fn refusal(c: &Command, rule: &Rule) -> Option<String> {
    if !git2::Reference::is_valid_name(&c.name) || c.name.chars().any(char::is_control) {
        return Some("not a valid ref name".to_owned());
    }
    if c.new.bytes().all(|b| b == b'0') {
        return Some("deletions are not allowed".to_owned());
    }
    if let Some(branch) = c.name.strip_prefix("refs/heads/") {
        if rule
            .branches
            .iter()
            .any(|p| crate::git::guard::glob(p.as_bytes(), branch.as_bytes()))
        {
            return None;
        }
        return Some(format!(
            "not an allowed branch ({})",
            rule.branches.join(", ")
        ));
    }
    if c.name.starts_with("refs/tags/") {
        return (!rule.tags).then(|| "tags are not allowed (--tags)".to_owned());
    }
    Some("only branches (and tags, when allowed) may be pushed".to_owned())
}

/// Write `payload` as one pkt-line to `out`.
fn pkt(out: &mut Vec<u8>, payload: &[u8]) {
    out.extend_from_slice(format!("{:04x}", payload.len() + 4).as_bytes());
    out.extend_from_slice(payload);
}

/// The HTTP answer that refuses a push: git shows `message` (as the
/// remote's) and each ref of `refused` as rejected with its reason.
#[must_use]
pub fn refused_answer(message: &str, refused: &[(String, String)], caps: &[String]) -> Vec<u8> {
    let sideband = caps
        .iter()
        .any(|c| c == "side-band-64k" || c == "side-band");
    let report = caps
        .iter()
        .any(|c| c == "report-status" || c == "report-status-v2");
    let mut status = Vec::new();
    if report {
        pkt(&mut status, b"unpack ok\n");
        for (name, why) in refused {
            pkt(&mut status, format!("ng {name} {why}\n").as_bytes());
        }
        status.extend_from_slice(b"0000");
    }
    let mut body = Vec::new();
    if sideband {
        let text = format!("keystone: {message}\n");
        pkt(&mut body, &[&[2u8][..], text.as_bytes()].concat());
        for piece in status.chunks(60_000) {
            pkt(&mut body, &[&[1u8][..], piece].concat());
        }
        body.extend_from_slice(b"0000");
    } else {
        body = status;
    }
    let mut out = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-git-receive-pack-result\r\n\
         Cache-Control: no-cache\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> Rule {
        Rule {
            url: "https://forge.example/acme/app".into(),
            path: "/acme/app".into(),
            user: "x-access-token".into(),
            placeholder: "keystone-placeholder-1".into(),
            token: "tok3n".into(),
            branches: vec!["agent/*".into()],
            tags: false,
        }
    }

    #[test]
    fn only_the_repositorys_own_endpoints_get_the_token() {
        let r = rule();
        for (m, t, e) in [
            (
                "GET",
                "/acme/app/info/refs?service=git-receive-pack",
                Some(Endpoint::InfoRefs),
            ),
            (
                "GET",
                "/acme/app.git/info/refs?service=git-upload-pack",
                Some(Endpoint::InfoRefs),
            ),
            (
                "POST",
                "/acme/app.git/git-receive-pack",
                Some(Endpoint::ReceivePack),
            ),
            (
                "POST",
                "/acme/app/git-upload-pack",
                Some(Endpoint::UploadPack),
            ),
            ("GET", "/acme/app/info/refs", None),
            (
                "GET",
                "/acme/app/info/refs?service=git-receive-pack&x=1",
                None,
            ),
            ("POST", "/acme/app/../other/git-receive-pack", None),
            ("POST", "/acme/application/git-receive-pack", None),
            ("POST", "/acme/app%2f../x/git-receive-pack", None),
            ("GET", "/acme/app/git-receive-pack", None),
            ("POST", "/ACME/app/git-receive-pack", None),
            ("GET", "/acme/app", None),
        ] {
            assert_eq!(endpoint(m, t, &r), e, "{m} {t}");
        }
    }

    #[test]
    fn the_placeholder_becomes_the_token_in_basic_only() {
        let r = rule();
        let e = base64::engine::general_purpose::STANDARD;
        let sent = format!("Basic {}", e.encode("anyone:keystone-placeholder-1"));
        let out = swap_basic(sent.as_bytes(), &r).unwrap();
        assert_eq!(
            out,
            format!("Basic {}", e.encode("x-access-token:tok3n")).into_bytes()
        );
        for other in [
            format!("Basic {}", e.encode("anyone:keystone-placeholder-10")),
            format!("Basic {}", e.encode("keystone-placeholder-1")),
            "Bearer keystone-placeholder-1".to_owned(),
            "Basic !!!".to_owned(),
        ] {
            assert_eq!(swap_basic(other.as_bytes(), &r), None, "{other}");
        }
    }

    fn line(s: &str) -> Vec<u8> {
        let mut v = Vec::new();
        pkt(&mut v, s.as_bytes());
        v
    }

    #[test]
    fn commands_are_read_to_their_flush_and_checked() {
        let z = "0".repeat(40);
        let a = "a".repeat(40);
        let mut body = line(&format!(
            "{z} {a} refs/heads/agent/x\0report-status side-band-64k\n"
        ));
        body.extend(line(&format!("{a} {z} refs/heads/agent/y\n")));
        assert_eq!(commands(&body), Ok(None), "no flush yet");
        body.extend_from_slice(b"0000PACK....");
        let (list, caps) = commands(&body).unwrap().unwrap();
        assert_eq!(list.len(), 2);
        assert!(caps.contains(&"side-band-64k".to_owned()));
        let r = rule();
        assert_eq!(refusal(&list[0], &r), None);
        assert_eq!(refusal(&list[1], &r).unwrap(), "deletions are not allowed");
        let c = |name: &str| Command {
            old: z.clone(),
            new: a.clone(),
            name: name.into(),
        };
        assert!(
            refusal(&c("refs/heads/main"), &r)
                .unwrap()
                .contains("agent/*")
        );
        assert!(refusal(&c("refs/tags/v1"), &r).is_some());
        assert!(refusal(&c("refs/notes/x"), &r).is_some());
        assert!(refusal(&c("refs/heads/agent/../main"), &r).is_some());
        let mut tags = r.clone();
        tags.tags = true;
        assert_eq!(refusal(&c("refs/tags/v1"), &tags), None);
        assert!(commands(&line("push-cert\0caps\n")).is_err());
        // Push options reach the forge's own handling: refused, on any line.
        let opts = format!("{z} {a} refs/heads/agent/x\0report-status push-options\n");
        assert!(commands(&[line(&opts), b"0000".to_vec()].concat()).is_err());
        let later = [
            line(&format!("{z} {a} refs/heads/agent/x\0report-status\n")),
            line(&format!("{z} {a} refs/heads/agent/y\0push-options\n")),
            b"0000".to_vec(),
        ]
        .concat();
        assert!(commands(&later).is_err());
        // The end of the commands, found reading each byte once.
        let mut at = 0;
        let whole = [line("x"), line("y"), b"0000PACK".to_vec()].concat();
        assert_eq!(commands_end(&whole[..3], &mut at), Ok(None));
        assert_eq!(commands_end(&whole[..7], &mut at), Ok(None));
        assert_eq!(at, 5);
        assert_eq!(commands_end(&whole, &mut at), Ok(Some(14)));
        assert_eq!(commands_end(b"00zz", &mut 0), Err(NotPktLines));
        assert!(commands(b"zzzz").is_err());
        assert!(commands(&line("x y z\n")).is_err());
    }

    #[test]
    fn only_whole_forms_of_the_token_are_masked() {
        // A run of the token (or of its Authorization form, which starts
        // with what everyone knows) masked would answer the sandbox's
        // guesses, one byte at a time.
        for form in secret_forms(&rule()) {
            let masks = super::super::mask::whole_forms(&form);
            assert!(masks.iter().all(|m| m.len() >= form.len()), "{masks:?}");
        }
    }

    #[test]
    fn a_refusal_is_a_report_git_shows() {
        let caps = vec!["report-status".to_owned(), "side-band-64k".to_owned()];
        let out = refused_answer(
            "push refused",
            &[("refs/heads/main".into(), "not an allowed branch".into())],
            &caps,
        );
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("\u{2}keystone: push refused\n"), "{text}");
        assert!(
            text.contains("ng refs/heads/main not an allowed branch\n"),
            "{text}"
        );
        assert!(text.ends_with("0000"), "{text}");
    }
}
