//! The git identity of a sandbox: the `user.name` and `user.email` its
//! workspace's git configuration gets at creation, so that the first commit
//! inside does not fail with "Author identity unknown".

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest accepted name, in bytes.
pub const NAME_MAX: usize = 256;

/// Longest accepted e-mail address, in bytes.
pub const EMAIL_MAX: usize = 256;

/// A name and an e-mail address, checked: no control characters (no
/// newline can reach the git configuration), no `<` or `>`, within
/// [`NAME_MAX`] and [`EMAIL_MAX`], an address without spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    name: String,
    email: String,
}

impl Identity {
    /// `name` (without leading or trailing spaces) and `email`, if both
    /// are acceptable.
    ///
    /// # Errors
    /// What is wrong with either, in one sentence.
    pub fn new(name: &str, email: &str) -> Result<Self, String> {
        let name = name.trim_matches(' ');
        let shown = |s: &str| {
            let mut t: String = s
                .chars()
                .take(64)
                .collect::<String>()
                .escape_debug()
                .to_string();
            if s.chars().count() > 64 {
                t.push('…');
            }
            t
        };
        let bad = |s: &str| s.chars().any(|c| c.is_control() || c == '<' || c == '>');
        if name.is_empty() {
            return Err("the name is empty".to_owned());
        }
        if name.len() > NAME_MAX {
            return Err(format!("the name is over {NAME_MAX} bytes"));
        }
        if bad(name) {
            return Err(format!(
                "the name \"{}\" holds a control character, '<' or '>'",
                shown(name)
            ));
        }
        if email.is_empty() {
            return Err("the e-mail address is empty".to_owned());
        }
        if email.len() > EMAIL_MAX {
            return Err(format!("the e-mail address is over {EMAIL_MAX} bytes"));
        }
        if bad(email) || email.chars().any(char::is_whitespace) {
            return Err(format!(
                "the e-mail address \"{}\" holds a space, a control character, '<' or '>'",
                shown(email)
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            email: email.to_owned(),
        })
    }

    /// The name (`user.name`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The e-mail address (`user.email`).
    #[must_use]
    pub fn email(&self) -> &str {
        &self.email
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} <{}>", self.name, self.email)
    }
}

/// Which git identity a new sandbox's workspace gets.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GitIdentity {
    /// The owner's: `user.name` and `user.email` from the project's git
    /// configuration, else the owner's own (`~/.gitconfig`,
    /// `~/.config/git/config`), read as the owner. Written `owner`.
    #[default]
    Owner,
    /// None: commits inside fail until one is set there. Written `none`.
    None,
    /// This one. Written `Name <email>`.
    Given(Identity),
}

impl GitIdentity {
    /// Whether it is [`GitIdentity::Owner`] (left out of the JSON then).
    #[must_use]
    pub fn is_owner(&self) -> bool {
        *self == Self::Owner
    }
}

impl fmt::Display for GitIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Owner => f.write_str("owner"),
            Self::None => f.write_str("none"),
            Self::Given(id) => id.fmt(f),
        }
    }
}

impl FromStr for GitIdentity {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "owner" => return Ok(Self::Owner),
            "none" => return Ok(Self::None),
            _ => {}
        }
        let hint = "write it as \"Your Name <you@example.com>\", or `none` for no identity, \
                    or `owner` for the owner's";
        if s.len() > NAME_MAX + EMAIL_MAX + 3 {
            return Err(format!(
                "the git identity is over {} bytes; {hint}",
                NAME_MAX + EMAIL_MAX + 3
            ));
        }
        let parsed = s
            .strip_suffix('>')
            .and_then(|rest| rest.rsplit_once('<'))
            .ok_or_else(|| "it is not of the form NAME <EMAIL>".to_owned())
            .and_then(|(name, email)| Identity::new(name, email));
        parsed.map(Self::Given).map_err(|why| {
            format!(
                "the git identity \"{}\" is not usable: {why}; {hint}",
                s.escape_debug()
            )
        })
    }
}

impl TryFrom<String> for GitIdentity {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<GitIdentity> for String {
    fn from(g: GitIdentity) -> Self {
        g.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_the_three_forms() {
        assert_eq!("owner".parse::<GitIdentity>().unwrap(), GitIdentity::Owner);
        assert_eq!("none".parse::<GitIdentity>().unwrap(), GitIdentity::None);
        let g: GitIdentity = "  Ada Lovelace  <ada@example.com>".parse().unwrap();
        assert_eq!(g.to_string(), "Ada Lovelace <ada@example.com>");
        let GitIdentity::Given(id) = &g else {
            panic!("{g:?}")
        };
        assert_eq!((id.name(), id.email()), ("Ada Lovelace", "ada@example.com"));
        let json = serde_json::to_string(&g).unwrap();
        assert_eq!(json, "\"Ada Lovelace <ada@example.com>\"");
        assert_eq!(serde_json::from_str::<GitIdentity>(&json).unwrap(), g);
        assert!(serde_json::from_str::<GitIdentity>("\"x\\n <y>\"").is_err());
        assert!(serde_json::from_str::<GitIdentity>("\"x\\ty <y>\"").is_err());
    }

    #[test]
    fn refuses_what_git_or_its_config_would_not_take() {
        let long = "a".repeat(NAME_MAX + 1);
        for bad in [
            "",
            "Ada",
            "<ada@example.com>",
            "Ada <>",
            "Ada ada@example.com",
            "Ada <ada@example.com",
            "Ada\n[core]\nhooksPath = /tmp <ada@example.com>",
            "Ada <ada@example.com\n>",
            "Ada <ada @example.com>",
            "Ada <a<b@example.com>",
            "A>da <ada@example.com>",
            "Ada\u{0} <ada@example.com>",
            "Ada\u{85} <ada@example.com>",
            &format!("{long} <ada@example.com>"),
            &format!("Ada <{}@example.com>", "a".repeat(EMAIL_MAX)),
        ] {
            let e = bad.parse::<GitIdentity>().unwrap_err();
            assert!(e.contains("Your Name <you@example.com>"), "{bad:?}: {e}");
            assert!(!e.contains('\n'), "{bad:?}: {e}");
        }
    }
}
