//! Authorisation per user, from RBAC Roles, as a real API server's RBAC
//! authoriser decides it (the contract is in docs/kubernetes.md, "The fake
//! API server"):
//!
//! - A request's user is named by its bearer token: `fake-token-<user>`
//!   ([`crate::FakeKube::kubeconfig_as`] writes one). Any other token
//!   (`fake-token`, written by [`crate::FakeKube::kubeconfig`]), or none,
//!   is an unrestricted user, as are users no Role is bound to.
//! - A user bound to Roles ([`crate::FakeKube::bind`]) may do exactly what
//!   their rules grant, in each Role's namespace: `apiGroups`, `resources`
//!   (`pods`, `pods/exec`, `*`, `*/exec`, `pods/*`), `verbs` and
//!   `resourceNames` (which never grant `list`, `watch`, `create` or
//!   `deletecollection`), `*` matching all.
//! - The verb is the request's, as the API server derives it: `get`
//!   (GET of a name), `list`, `watch` (`?watch=true`), `create` (POST),
//!   `update` (PUT), `patch`, `delete`, `deletecollection` (DELETE of a
//!   collection). A server-side apply that makes a missing object needs
//!   `create` as well as `patch`. A WebSocket upgrade of `pods/exec` or
//!   `pods/portforward` is a GET (`get`) that needs `create` as well, as
//!   Kubernetes 1.35 and later check it.
//! - Anything not granted answers 403 with a `Status` of reason
//!   `Forbidden`, worded as a real server words it, and changes nothing.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// The token prefix that names a user.
pub const TOKEN_PREFIX: &str = "fake-token-";

/// One RBAC Role: its namespace and rules.
#[derive(Clone, Debug)]
pub struct Role {
    namespace: String,
    rules: Vec<Rule>,
}

#[derive(Clone, Debug)]
struct Rule {
    api_groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
    resource_names: Vec<String>,
}

impl Role {
    /// A `rbac.authorization.k8s.io/v1` Role from its YAML (or JSON).
    ///
    /// # Errors
    /// When it is not valid YAML, not a Role, has no namespace, or a rule
    /// lacks `apiGroups`, `resources` or `verbs` (a real API server would
    /// refuse it), with what is wrong.
    pub fn from_yaml(text: &str) -> Result<Self, String> {
        let v: Value = serde_saphyr::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
        Self::from_value(&v)
    }

    fn from_value(v: &Value) -> Result<Self, String> {
        if v["kind"] != "Role" || v["apiVersion"] != "rbac.authorization.k8s.io/v1" {
            return Err(format!(
                "not a rbac.authorization.k8s.io/v1 Role: kind {}, apiVersion {}",
                v["kind"], v["apiVersion"]
            ));
        }
        let name = v["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let Some(namespace) = v["metadata"]["namespace"].as_str() else {
            return Err(format!("Role '{name}' has no metadata.namespace"));
        };
        let strings = |r: &Value, key: &str, required: bool| -> Result<Vec<String>, String> {
            match &r[key] {
                Value::Null if !required => Ok(Vec::new()),
                Value::Array(items) => items
                    .iter()
                    .map(|i| {
                        i.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| format!("Role '{name}': {key} holds {i}, not a string"))
                    })
                    .collect(),
                other => Err(format!("Role '{name}': {key} is {other}, not a list")),
            }
        };
        let rules = v["rules"]
            .as_array()
            .ok_or_else(|| format!("Role '{name}' has no rules"))?
            .iter()
            .map(|r| {
                Ok(Rule {
                    api_groups: strings(r, "apiGroups", true)?,
                    resources: strings(r, "resources", true)?,
                    verbs: strings(r, "verbs", true)?,
                    resource_names: strings(r, "resourceNames", false)?,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            namespace: namespace.to_owned(),
            rules,
        })
    }

    /// Every (API group, resource, verb) its rules name, wildcards as
    /// written.
    fn grants(&self) -> impl Iterator<Item = Grant> + '_ {
        self.rules.iter().flat_map(|r| {
            r.api_groups.iter().flat_map(move |g| {
                r.resources.iter().flat_map(move |res| {
                    r.verbs.iter().map(move |v| Grant {
                        group: g.clone(),
                        resource: res.clone(),
                        verb: v.clone(),
                    })
                })
            })
        })
    }

    fn allows(&self, a: &Attributes, verb: &str) -> bool {
        a.namespace == self.namespace
            && self.rules.iter().any(|r| {
                let any = |list: &[String], want: &str| list.iter().any(|x| x == "*" || x == want);
                let resource = a.resource_path();
                any(&r.api_groups, a.group)
                    && any(&r.verbs, verb)
                    && r.resources.iter().any(|x| {
                        x == "*"
                            || *x == resource
                            || a.subresource.as_deref().is_some_and(|s| {
                                *x == format!("*/{s}") || *x == format!("{}/*", a.resource)
                            })
                    })
                    && (r.resource_names.is_empty()
                        || a.name.as_ref().is_some_and(|n| {
                            !matches!(verb, "list" | "watch" | "create" | "deletecollection")
                                && r.resource_names.contains(n)
                        }))
            })
    }
}

/// What a Role grants: one API group, resource and verb.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    /// The API group (`""` for the core group).
    pub group: String,
    /// The resource, with its subresource (`pods/exec`).
    pub resource: String,
    /// The verb.
    pub verb: String,
}

impl std::fmt::Display for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{} {} ({group})", self.verb, self.resource)
    }
}

/// What a request asks to do.
#[derive(Clone, Debug)]
pub(crate) struct Attributes {
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: Option<String>,
    pub namespace: String,
    pub name: Option<String>,
}

impl Attributes {
    fn resource_path(&self) -> String {
        match &self.subresource {
            Some(s) => format!("{}/{s}", self.resource),
            None => self.resource.to_owned(),
        }
    }
}

/// The Roles bound to each user, and what was asked of them.
#[derive(Default)]
pub(crate) struct Authorizer {
    roles: BTreeMap<String, Vec<Role>>,
    /// Per user: the grants requests were allowed by.
    used: BTreeMap<String, BTreeSet<Grant>>,
    /// Every refusal's message, in order.
    denied: Vec<String>,
}

impl Authorizer {
    pub fn bind(&mut self, user: &str, role: Role) {
        self.roles.entry(user.to_owned()).or_default().push(role);
    }

    /// The user a request's `Authorization` header names, if any.
    pub fn user_of(header: Option<&str>) -> Option<String> {
        header?
            .strip_prefix("Bearer ")?
            .strip_prefix(TOKEN_PREFIX)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
    }

    /// Whether `user` may do `verb` on `a`; a refusal is recorded and
    /// returned as the 403 `Status` a real server gives.
    pub fn check(&mut self, user: Option<&str>, a: &Attributes, verb: &str) -> Result<(), Value> {
        let Some((user, roles)) = user.and_then(|u| self.roles.get(u).map(|r| (u, r))) else {
            return Ok(());
        };
        if roles.iter().any(|r| r.allows(a, verb)) {
            self.used.entry(user.to_owned()).or_default().insert(Grant {
                group: a.group.to_owned(),
                resource: a.resource_path(),
                verb: verb.to_owned(),
            });
            return Ok(());
        }
        let qualified = if a.group.is_empty() {
            a.resource.to_owned()
        } else {
            format!("{}.{}", a.resource, a.group)
        };
        let what = match &a.name {
            Some(n) => format!("{qualified} \"{n}\""),
            None => qualified,
        };
        // (A Role never grants a cluster-scoped resource.)
        let scope = if a.namespace.is_empty() {
            "at the cluster scope".to_owned()
        } else {
            format!("in the namespace \"{}\"", a.namespace)
        };
        let message = format!(
            "{what} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}",
            a.resource_path(),
            a.group,
        );
        self.denied.push(message.clone());
        let mut details = serde_json::json!({"group": a.group, "kind": a.resource});
        if let Some(n) = &a.name {
            details["name"] = n.clone().into();
        }
        Err(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "Forbidden", "details": details, "code": 403,
        }))
    }

    /// What `user`'s Roles grant that no request of theirs needed
    /// (wildcards count as used once anything matched them).
    pub fn unused(&self, user: &str) -> Vec<Grant> {
        let used = self.used.get(user);
        let Some(roles) = self.roles.get(user) else {
            return Vec::new();
        };
        let mut unused: Vec<Grant> = roles
            .iter()
            .flat_map(Role::grants)
            .filter(|g| {
                !used.is_some_and(|u| {
                    u.iter().any(|x| {
                        (g.group == "*" || g.group == x.group)
                            && (g.verb == "*" || g.verb == x.verb)
                            && (g.resource == "*"
                                || g.resource == x.resource
                                || g.resource.strip_prefix("*/").is_some_and(|s| {
                                    x.resource.split_once('/').is_some_and(|(_, xs)| xs == s)
                                })
                                || g.resource.strip_suffix("/*").is_some_and(|r| {
                                    x.resource.split_once('/').is_some_and(|(xr, _)| xr == r)
                                }))
                    })
                })
            })
            .collect();
        unused.sort();
        unused.dedup();
        unused
    }

    pub fn denied(&self) -> Vec<String> {
        self.denied.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(resource: &'static str, sub: Option<&str>, name: Option<&str>) -> Attributes {
        Attributes {
            group: if resource == "networkpolicies" {
                "networking.k8s.io"
            } else {
                ""
            },
            resource,
            subresource: sub.map(str::to_owned),
            namespace: "ns".to_owned(),
            name: name.map(str::to_owned),
        }
    }

    #[test]
    fn rules_grant_what_they_name_and_refusals_read_as_a_real_server_s() {
        let role = Role::from_yaml(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\n\
             metadata: {name: r, namespace: ns}\nrules:\n\
             - apiGroups: [\"\"]\n  resources: [pods, '*/exec']\n  verbs: [get, list]\n\
             - apiGroups: [networking.k8s.io]\n  resources: [networkpolicies]\n  verbs: ['*']\n  resourceNames: [p]\n",
        )
        .unwrap();
        let mut a = Authorizer::default();
        a.bind("u", role);
        let check = |a: &mut Authorizer, at: &Attributes, verb: &str| {
            a.check(Some("u"), at, verb)
                .map_err(|s| s["message"].clone())
        };
        assert!(check(&mut a, &attrs("pods", None, Some("x")), "get").is_ok());
        assert!(check(&mut a, &attrs("pods", None, None), "list").is_ok());
        assert!(check(&mut a, &attrs("pods", Some("exec"), Some("x")), "get").is_ok());
        assert_eq!(
            check(
                &mut a,
                &attrs("pods", Some("portforward"), Some("x")),
                "create"
            )
            .unwrap_err(),
            "pods \"x\" is forbidden: User \"u\" cannot create resource \"pods/portforward\" in API group \"\" in the namespace \"ns\""
        );
        assert!(check(&mut a, &attrs("networkpolicies", None, Some("p")), "delete").is_ok());
        assert_eq!(
            check(&mut a, &attrs("networkpolicies", None, Some("q")), "get").unwrap_err(),
            "networkpolicies.networking.k8s.io \"q\" is forbidden: User \"u\" cannot get resource \"networkpolicies\" in API group \"networking.k8s.io\" in the namespace \"ns\""
        );
        // resourceNames never grant a list.
        assert!(check(&mut a, &attrs("networkpolicies", None, None), "list").is_err());
        // A Role grants nothing at the cluster scope, even with `*`.
        let mut b = Authorizer::default();
        b.bind(
            "u",
            Role::from_yaml(
                "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\n\
                 metadata: {name: all, namespace: ns}\nrules:\n\
                 - apiGroups: ['*']\n  resources: ['*']\n  verbs: ['*']\n",
            )
            .unwrap(),
        );
        let classes = Attributes {
            group: "snapshot.storage.k8s.io",
            resource: "volumesnapshotclasses",
            subresource: None,
            namespace: String::new(),
            name: None,
        };
        assert_eq!(
            check(&mut b, &classes, "list").unwrap_err(),
            "volumesnapshotclasses.snapshot.storage.k8s.io is forbidden: User \"u\" cannot list resource \"volumesnapshotclasses\" in API group \"snapshot.storage.k8s.io\" at the cluster scope"
        );
        // Another namespace: nothing.
        let mut other = attrs("pods", None, Some("x"));
        other.namespace = "elsewhere".to_owned();
        assert!(check(&mut a, &other, "get").is_err());
        // Users without Roles, and unnamed ones, are not restricted.
        assert!(
            a.check(Some("v"), &attrs("pods", None, None), "delete")
                .is_ok()
        );
        assert!(a.check(None, &attrs("pods", None, None), "delete").is_ok());
        assert_eq!(a.denied().len(), 4);
        let unused: Vec<String> = a.unused("u").iter().map(ToString::to_string).collect();
        assert_eq!(unused, ["list */exec (core)"]);
        assert_eq!(
            Authorizer::user_of(Some("Bearer fake-token-u")).as_deref(),
            Some("u")
        );
        assert_eq!(Authorizer::user_of(Some("Bearer fake-token")), None);
        assert!(Role::from_yaml("kind: ClusterRole").is_err());
    }
}
