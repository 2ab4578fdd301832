//! The git identity a new workspace gets (`user.name`, `user.email` in its
//! own `.git/config`, which every backend shows as `/workspace/.git/config`):
//! the one the person gave, none, or the owner's, found as git would find it
//! (the project's configuration, then `~/.gitconfig`, then
//! `~/.config/git/config`) by the prepare helper, which runs as the owner.
//!
//! The files are read, not handed to libgit2, so that nothing they include
//! or name is followed, and only what a person's own configuration can be:
//! a regular file of the owner's (or root's, as a NixOS or home-manager
//! configuration is) of at most [`CONFIG_MAX`] bytes. The project's file is
//! opened without following any symlink below the project, which the
//! project's writers (another sandbox, when a sandbox's workspace is made a
//! project) could have planted; the owner's own may be a link (home-manager
//! makes them links into the Nix store).

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use keystone_agent_api::{GitIdentity, Identity};
use nix::fcntl::{OFlag, open, openat};
use nix::sys::stat::Mode;

use super::workspace::{PrepareEvent, WorkspaceHelperError};

/// Largest git configuration file read for an identity.
pub const CONFIG_MAX: u64 = 256 << 10;

/// Give the workspace at `dest` the identity `choice` asks for, reporting
/// what it got as a notice. Runs as the owner, in the prepare helper.
pub fn apply(
    host: &git2::Repository,
    project: &Path,
    dest: &Path,
    choice: &GitIdentity,
    event: &mut dyn FnMut(&PrepareEvent),
) -> Result<(), WorkspaceHelperError> {
    let mut notice = |message: String| event(&PrepareEvent::Notice { message });
    let (id, whence) = match choice {
        GitIdentity::None => return Ok(()),
        GitIdentity::Given(id) => (id.clone(), "as asked".to_owned()),
        GitIdentity::Owner => {
            let home = std::env::var_os("HOME").map(PathBuf::from);
            match owner_identity(host, project, home.as_deref(), &mut notice) {
                Ok(found) => found,
                Err(missing) => {
                    notice(format!(
                        "no git identity found ({missing} in the project's git configuration, \
                         ~/.gitconfig or ~/.config/git/config): commits inside fail until one \
                         is set there (`git config user.name …`, `git config user.email …`); \
                         `agentctl create --git-identity \"Name <email>\"` gives one"
                    ));
                    return Ok(());
                }
            }
        }
    };
    let mut config = git2::Config::open(&dest.join(".git/config"))?;
    config.set_str("user.name", id.name())?;
    config.set_str("user.email", id.email())?;
    notice(format!(
        "commits in the sandbox are by {id} ({whence}; `--git-identity` at creation chooses another)"
    ));
    Ok(())
}

/// The owner's identity and where it came from, or which key was missing.
fn owner_identity(
    host: &git2::Repository,
    project: &Path,
    home: Option<&Path>,
    notice: &mut dyn FnMut(String),
) -> Result<(Identity, String), &'static str> {
    let mut sources: Vec<(String, std::io::Result<Option<String>>)> = vec![(
        "the project's git configuration".to_owned(),
        project_config(host, project),
    )];
    if let Some(home) = home {
        for rel in [".gitconfig", ".config/git/config"] {
            sources.push((format!("~/{rel}"), own_config(&home.join(rel))));
        }
    }
    // Each value found first, with the source it came from.
    let mut name: Option<(String, &str)> = None;
    let mut email: Option<(String, &str)> = None;
    for (what, text) in &sources {
        let text = match text {
            Ok(Some(t)) => t,
            Ok(None) => continue,
            Err(e) => {
                notice(format!("{what} was not read for a git identity: {e}"));
                continue;
            }
        };
        let (n, e) = user_of(text);
        if name.is_none() {
            name = n.map(|n| (n, what.as_str()));
        }
        if email.is_none() {
            email = e.map(|e| (e, what.as_str()));
        }
    }
    let (Some((name, from_n)), Some((email, from_e))) = (name, email) else {
        return Err("user.name or user.email is missing");
    };
    let id = Identity::new(&name, &email).map_err(|why| {
        notice(format!("the git identity found is not usable: {why}"));
        "a usable user.name and user.email are missing"
    })?;
    let whence = if from_n == from_e {
        format!("from {from_n}")
    } else {
        format!("name from {from_n}, e-mail from {from_e}")
    };
    Ok((id, whence))
}

/// The project's own configuration: `.git/config` below the project with
/// no symlink on the way; for a project whose `.git` is a file (a linked
/// worktree) or that is bare, `config` in the common directory libgit2
/// found, not following a final symlink.
fn project_config(host: &git2::Repository, project: &Path) -> std::io::Result<Option<String>> {
    let root = crate::beneath::open_root(project)?;
    let (dir, name) = match crate::beneath::open_dir(root.as_fd(), Path::new(".git")) {
        Ok(d) => (d, "config"),
        Err(_) if !host.is_bare() && project.join(".git").is_dir() => {
            return Err(std::io::Error::other(
                ".git is a symbolic link or crosses a mount",
            ));
        }
        Err(_) => (crate::beneath::open_root(host.commondir())?, "config"),
    };
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    match openat(&dir, name, flags, Mode::empty()) {
        Ok(fd) => read_limited(fd).map(Some),
        Err(nix::errno::Errno::ENOENT) => Ok(None),
        Err(nix::errno::Errno::ELOOP) => Err(std::io::Error::other("it is a symbolic link")),
        Err(e) => Err(e.into()),
    }
}

/// One of the owner's own configuration files, `None` when there is none.
fn own_config(path: &Path) -> std::io::Result<Option<String>> {
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
    match open(path, flags, Mode::empty()) {
        Ok(fd) => read_limited(fd).map(Some),
        Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTDIR) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The text of `fd`: a regular file of this process's user or root, at
/// most [`CONFIG_MAX`] bytes.
fn read_limited(fd: OwnedFd) -> std::io::Result<String> {
    let file = std::fs::File::from(fd);
    let meta = file.metadata()?;
    let me = nix::unistd::Uid::effective().as_raw();
    if !meta.is_file() {
        return Err(std::io::Error::other("it is not a regular file"));
    }
    if meta.uid() != me && meta.uid() != 0 {
        return Err(std::io::Error::other(format!(
            "it belongs to uid {}, neither you nor root",
            meta.uid()
        )));
    }
    if meta.len() > CONFIG_MAX {
        return Err(std::io::Error::other(format!(
            "it is over {} KiB",
            CONFIG_MAX >> 10
        )));
    }
    let mut text = String::new();
    file.take(CONFIG_MAX).read_to_string(&mut text)?;
    Ok(text)
}

/// `user.name` and `user.email` as git reads them from one configuration
/// file's text (the last of each wins; `include`s are not followed).
#[must_use]
pub fn user_of(text: &str) -> (Option<String>, Option<String>) {
    let c: Vec<char> = text.chars().collect();
    let (mut i, mut in_user) = (0, false);
    let (mut name, mut email) = (None, None);
    let skip_line = |i: &mut usize| {
        while *i < c.len() && c[*i] != '\n' {
            *i += 1;
        }
    };
    while i < c.len() {
        match c[i] {
            ch if ch.is_whitespace() => i += 1,
            '#' | ';' => skip_line(&mut i),
            '[' => {
                let start = i + 1;
                let mut quoted = false;
                while i < c.len() && c[i] != '\n' && (quoted || c[i] != ']') {
                    if c[i] == '"' {
                        quoted = !quoted;
                    } else if c[i] == '\\' && quoted {
                        i += 1;
                    }
                    i += 1;
                }
                let header: String = c[start..i.min(c.len())].iter().collect();
                in_user = c.get(i) == Some(&']') && header.trim().eq_ignore_ascii_case("user");
                i += 1;
            }
            ch if ch.is_ascii_alphabetic() => {
                let start = i;
                while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '-') {
                    i += 1;
                }
                let key: String = c[start..i].iter().collect::<String>().to_ascii_lowercase();
                while i < c.len() && (c[i] == ' ' || c[i] == '\t') {
                    i += 1;
                }
                let value = if c.get(i) == Some(&'=') {
                    i += 1;
                    value_at(&c, &mut i)
                } else {
                    // A key alone is boolean true: no name or address.
                    skip_line(&mut i);
                    None
                };
                match (in_user, key.as_str()) {
                    (true, "name") => name = value,
                    (true, "email") => email = value,
                    _ => {}
                }
            }
            _ => skip_line(&mut i),
        }
    }
    (name, email)
}

/// A value from `c[*i]` to its line's end, as git reads it: leading and
/// trailing blanks dropped outside quotes, `"` toggling quoting, `\`
/// escapes and line continuations, `#` and `;` starting a comment outside
/// quotes. `None` for what git would refuse (a bad escape, an open quote).
fn value_at(c: &[char], i: &mut usize) -> Option<String> {
    let (mut out, mut quoted, mut space, mut comment, mut ok) =
        (String::new(), false, 0, false, true);
    while *i < c.len() {
        let ch = c[*i];
        *i += 1;
        if ch == '\n' {
            ok &= !quoted;
            break;
        }
        if comment {
            continue;
        }
        if ch.is_whitespace() && !quoted {
            if !out.is_empty() {
                space += 1;
            }
            continue;
        }
        if !quoted && (ch == '#' || ch == ';') {
            comment = true;
            continue;
        }
        out.extend(std::iter::repeat_n(' ', space));
        space = 0;
        match ch {
            '"' => quoted = !quoted,
            '\\' => {
                let next = c.get(*i).copied();
                *i += 1;
                match next {
                    Some('\n') => {}
                    Some('n') => out.push('\n'),
                    Some('t') => out.push('\t'),
                    Some('b') => out.push('\u{8}'),
                    Some(e @ ('"' | '\\')) => out.push(e),
                    _ => ok = false,
                }
            }
            _ => out.push(ch),
        }
    }
    (ok && !quoted).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_user_name_and_email_as_git_does() {
        let text = "# top\n[core]\n\tname = not-this\n[User]\n\tName = \"Ada  Lovelace\" ; who\n\
                    email=ada@example.com # work\n[user \"x\"]\n\temail = sub@example.com\n\
                    [alias]\n\tname = alias\n";
        assert_eq!(
            user_of(text),
            (Some("Ada  Lovelace".into()), Some("ada@example.com".into()))
        );
        // The last one wins; continuations, escapes, a key on the header's line.
        let text = "[user] name = First\n[user]\n  name = Sec\\\nond  \n  email = \"a\\\"b\"@x\n";
        assert_eq!(
            user_of(text),
            (Some("Second".into()), Some("a\"b@x".into()))
        );
        // A newline escape reaches the value (and Identity then refuses it).
        let (n, _) = user_of("[user]\nname = a\\nb\n");
        assert_eq!(n.as_deref(), Some("a\nb"));
        assert!(Identity::new(&n.unwrap(), "a@b").is_err());
        // What git refuses gives nothing.
        assert_eq!(user_of("[user]\nname = \"open\nemail\n"), (None, None));
        assert_eq!(user_of("[user]\nname = bad\\q\n").0, None);
        assert_eq!(user_of("[user.sub]\nname = x\n").0, None);
        assert_eq!(user_of("[include]\npath = ~/.other\n"), (None, None));
    }

    fn repo(dir: &Path) -> git2::Repository {
        git2::Repository::init(dir).unwrap()
    }

    #[test]
    fn the_project_comes_first_and_the_owner_fills_in() {
        let t = tempfile::tempdir().unwrap();
        let (project, home) = (t.path().join("p"), t.path().join("home"));
        let host = repo(&project);
        std::fs::create_dir_all(home.join(".config/git")).unwrap();
        std::fs::write(
            home.join(".gitconfig"),
            "[user]\nname = Home\nemail = home@x\n",
        )
        .unwrap();
        std::fs::write(home.join(".config/git/config"), "[user]\nname = Xdg\n").unwrap();
        let mut cfg = git2::Config::open(&project.join(".git/config")).unwrap();
        cfg.set_str("user.email", "project@x").unwrap();
        let mut notes = Vec::new();
        let (id, whence) =
            owner_identity(&host, &project, Some(&home), &mut |m| notes.push(m)).unwrap();
        assert_eq!(id.to_string(), "Home <project@x>");
        assert!(
            whence.contains("~/.gitconfig") && whence.contains("project"),
            "{whence}"
        );
        assert!(notes.is_empty(), "{notes:?}");

        // A project whose config is a symlink is not read, and says so.
        let elsewhere = t.path().join("elsewhere");
        std::fs::write(&elsewhere, "[user]\nname = Planted\nemail = planted@x\n").unwrap();
        std::fs::remove_file(project.join(".git/config")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, project.join(".git/config")).unwrap();
        let (id, _) = owner_identity(&host, &project, Some(&home), &mut |m| notes.push(m)).unwrap();
        assert_eq!(id.to_string(), "Home <home@x>");
        assert!(
            notes.iter().any(|n| n.contains("symbolic link")),
            "{notes:?}"
        );

        // Too large: not read.
        std::fs::write(home.join(".gitconfig"), "#".repeat(CONFIG_MAX as usize + 1)).unwrap();
        let missing = owner_identity(&host, &project, Some(&home), &mut |m| notes.push(m));
        assert!(missing.is_err());
        assert!(notes.iter().any(|n| n.contains("KiB")), "{notes:?}");
    }

    #[test]
    fn a_workspace_gets_the_identity_asked_for() {
        let t = tempfile::tempdir().unwrap();
        let (project, dest) = (t.path().join("p"), t.path().join("ws"));
        let host = repo(&project);
        repo(&dest);
        let given: GitIdentity = "Ada <ada@example.com>".parse().unwrap();
        let mut notes = Vec::new();
        apply(&host, &project, &dest, &given, &mut |e| {
            notes.push(format!("{e:?}"));
        })
        .unwrap();
        let cfg = git2::Config::open(&dest.join(".git/config")).unwrap();
        assert_eq!(cfg.get_string("user.name").unwrap(), "Ada");
        assert_eq!(cfg.get_string("user.email").unwrap(), "ada@example.com");
        assert!(notes[0].contains("Ada <ada@example.com>"), "{notes:?}");
    }
}
