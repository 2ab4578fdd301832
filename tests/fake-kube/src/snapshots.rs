//! VolumeSnapshots (`snapshot.storage.k8s.io/v1`), served when the server
//! is started with [`crate::FakeKube::with_volume_snapshots`], as a
//! cluster with the CSI external-snapshotter (its CRDs and snapshot
//! controller) and a CSI driver that takes snapshots serves them:
//!
//! - One VolumeSnapshotClass (cluster-scoped): [`CLASS`], of driver
//!   [`DRIVER`], the default one.
//! - A VolumeSnapshot of `spec.source.persistentVolumeClaimName` is cut a
//!   step after it is made: the claim's files
//!   ([`crate::FakeKube::claim_dir`]) are copied as they are then to the
//!   snapshot's own directory ([`crate::FakeKube::snapshot_dir`]), and in
//!   the same change its status says `readyToUse: true`, `restoreSize`
//!   (the copy's bytes), `creationTime` and `boundVolumeSnapshotContentName`
//!   (`snapcontent-<uid>`). Until then a client keeps the claim's files
//!   still, as on a real cluster. A snapshot of a claim that is missing or
//!   not bound, or of a class that does not exist, gets `readyToUse:
//!   false` and `status.error.message` as the snapshot controller words
//!   it, and a Warning event. Deleting one removes its files.
//! - A PersistentVolumeClaim whose `dataSourceRef` or `dataSource` is a
//!   VolumeSnapshot is `Pending`, and a step later holds a copy of the
//!   snapshot's files and is `Bound`. While the snapshot is missing or not
//!   ready, the claim stays `Pending` with a `ProvisioningFailed` Warning
//!   event naming it, until a snapshot of that name is ready (the CSI
//!   provisioner retries); Pods that mount it are not scheduled meanwhile.
//! - Copies keep modes, owners, times and symlinks (never followed), and
//!   are made as root of a user namespace, so that files their owner may
//!   not read are copied too.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::{Key, POD_STEP, Store};

/// The API group.
pub const GROUP: &str = "snapshot.storage.k8s.io";
/// Its API prefix.
pub(crate) const API: &str = "/apis/snapshot.storage.k8s.io/v1";
/// The VolumeSnapshotClass there is, the default one.
pub const CLASS: &str = "fake-snapclass";
/// Its CSI driver.
pub const DRIVER: &str = "fake.csi";
/// The annotation that makes a class the default of its driver.
pub const DEFAULT_CLASS: &str = "snapshot.storage.kubernetes.io/is-default-class";

/// The VolumeSnapshotClass [`CLASS`], of uid number `uid`.
pub(crate) fn class(uid: u64) -> Value {
    json!({
        "kind": "VolumeSnapshotClass", "apiVersion": format!("{GROUP}/v1"),
        "metadata": {"name": CLASS, "annotations": {DEFAULT_CLASS: "true"},
                     "uid": format!("00000000-0000-4000-8000-{uid:012}"),
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "driver": DRIVER,
        "deletionPolicy": "Delete",
    })
}

/// Where claim `name`'s files are.
pub(crate) fn claim_dir(root: &Path, namespace: &str, name: &str) -> PathBuf {
    root.join(namespace).join("pvc").join(name)
}

/// Where VolumeSnapshot `name`'s copy is, once it is ready.
pub(crate) fn snapshot_dir(root: &Path, namespace: &str, name: &str) -> PathBuf {
    root.join(namespace).join("volumesnapshots").join(name)
}

/// Put the VolumeSnapshotClass [`CLASS`] in.
pub(crate) fn add_class(s: &mut Store) {
    s.uid += 1;
    let class = class(s.uid);
    s.commit(&key("volumesnapshotclasses", "", CLASS), "ADDED", class);
}

/// Whether `name` is a DNS subdomain (RFC 1123), as the API server wants
/// objects' names: never `.`, `..` or one with a `/`.
pub(crate) fn valid_name(name: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    name.len() <= 253
        && name.bytes().next().is_some_and(alnum)
        && name.bytes().last().is_some_and(alnum)
        && name.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
}

/// Why new object `name` of `resource` in `namespace` (`""`: cluster-scoped)
/// is refused, as the API server's validation (a CRD's for a snapshot)
/// refuses it, if it is: names become paths here, as on a node.
pub(crate) fn invalid(resource: &str, namespace: &str, name: &str, o: &Value) -> Option<String> {
    if !valid_name(name) || !(namespace.is_empty() || valid_name(namespace)) {
        return Some(format!(
            "metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must \
             consist of lower case alphanumeric characters, '-' or '.', and must start and \
             end with an alphanumeric character"
        ));
    }
    let source = &o["spec"]["source"];
    let named = ["persistentVolumeClaimName", "volumeSnapshotContentName"]
        .iter()
        .filter(|k| source[**k].is_string())
        .count();
    (resource == "volumesnapshots" && named != 1).then(|| {
        "spec.source: Invalid value: \"object\": exactly one of volumeSnapshotContentName \
         and persistentVolumeClaimName must be set"
            .to_owned()
    })
}

/// The VolumeSnapshot a claim is to be made from, if it names one (its
/// `dataSourceRef`, else its `dataSource`).
pub(crate) fn source_of(claim: &Value) -> Option<String> {
    ["dataSourceRef", "dataSource"].iter().find_map(|field| {
        let s = &claim["spec"][field];
        if s["apiGroup"] == GROUP && s["kind"] == "VolumeSnapshot" {
            s["name"].as_str().map(str::to_owned)
        } else {
            None
        }
    })
}

/// `s` quoted as Go's `%q` quotes it (in the controllers' messages).
fn quoted(s: &str) -> String {
    serde_json::to_string(s).expect("a string")
}

fn uid_of(o: &Value) -> String {
    o["metadata"]["uid"].as_str().unwrap_or("").to_owned()
}

fn key(resource: &str, namespace: &str, name: &str) -> Key {
    (resource.to_owned(), namespace.to_owned(), name.to_owned())
}

/// What a snapshot is cut from: (claim, its uid, class), or why it cannot
/// be: (the event's reason, the status's message), as the snapshot
/// controller gives them.
fn input(s: &Store, snapshot: &Value) -> Result<(String, String, String), (String, String)> {
    let ns = snapshot["metadata"]["namespace"].as_str().unwrap_or("");
    let name = snapshot["metadata"]["name"].as_str().unwrap_or("");
    let named_class = snapshot["spec"]["volumeSnapshotClassName"].as_str();
    // Without a class named, the default one is found through the claim.
    let (reason, prefix) = match named_class {
        None => (
            "SetDefaultSnapshotClassFailed",
            "Failed to set default snapshot class with error ".to_owned(),
        ),
        Some(_) => (
            "SnapshotContentCreationFailed",
            format!(
                "Failed to create snapshot content with error failed to get input parameters to create snapshot {name}: "
            ),
        ),
    };
    // (Only with a class named is the inner error quoted once more.)
    let fail = |e: String| {
        let e = if named_class.is_some() { quoted(&e) } else { e };
        Err((reason.to_owned(), format!("{prefix}{e}")))
    };
    let Some(claim) = snapshot["spec"]["source"]["persistentVolumeClaimName"].as_str() else {
        return fail("this API server takes snapshots of claims only".to_owned());
    };
    let found = valid_name(claim)
        .then(|| s.objects.get(&key("persistentvolumeclaims", ns, claim)))
        .flatten();
    let Some(pvc) = found else {
        let missing = format!("persistentvolumeclaim {} not found", quoted(claim));
        return fail(format!(
            "failed to retrieve PVC {claim} from the lister: {}",
            quoted(&missing)
        ));
    };
    if pvc["status"]["phase"] != "Bound" {
        return fail(format!(
            "the PVC {claim} is not yet bound to a PV, will not attempt to take a snapshot"
        ));
    }
    let class = match named_class {
        Some(c) if s.objects.contains_key(&key("volumesnapshotclasses", "", c)) => c.to_owned(),
        Some(c) => {
            return fail(format!(
                "volumesnapshotclass.snapshot.storage.k8s.io {} not found",
                quoted(c)
            ));
        }
        None => {
            let default = s.objects.iter().find(|(k, o)| {
                k.0 == "volumesnapshotclasses"
                    && o["driver"] == DRIVER
                    && o["metadata"]["annotations"][DEFAULT_CLASS] == "true"
            });
            match default {
                Some((k, _)) => k.2.clone(),
                None => return fail("cannot find default snapshot class".to_owned()),
            }
        }
    };
    Ok((claim.to_owned(), uid_of(pvc), class))
}

/// Cut VolumeSnapshot `key` a step after it was made, as the snapshot
/// controller and the CSI driver do; then provision the claims that wait
/// for it.
pub(crate) async fn take(store: Arc<Mutex<Store>>, key: Key) {
    tokio::time::sleep(POD_STEP).await;
    let (ns, name) = (key.1.as_str(), key.2.as_str());
    let (uid, plan) = {
        let mut s = store.lock().unwrap();
        let Some(snapshot) = s.objects.get(&key) else {
            return;
        };
        let uid = uid_of(snapshot);
        let plan = input(&s, snapshot);
        s.uid += 1;
        let tmp = s
            .root
            .join(ns)
            .join("volumesnapshots")
            .join(format!(".{name}.{}", s.uid));
        let from = |claim: &str| claim_dir(&s.root, ns, claim);
        let plan =
            plan.map(|(claim, claim_uid, class)| (from(&claim), claim, claim_uid, class, tmp));
        (uid, plan)
    };
    let (from, claim, claim_uid, class, tmp) = match plan {
        Ok(p) => p,
        Err((reason, message)) => return fail(&store, &key, &uid, &reason, &message),
    };
    let copied = copy_off_thread(&from, &tmp).await;
    let mut s = store.lock().unwrap();
    let to = snapshot_dir(&s.root, ns, name);
    let Some(mut snapshot) = s.objects.get(&key).filter(|o| uid_of(o) == uid).cloned() else {
        drop(s);
        return remove(&tmp);
    };
    let claim_there = s
        .objects
        .get(&self::key("persistentvolumeclaims", ns, &claim))
        .is_some_and(|c| uid_of(c) == claim_uid);
    let published = copied.and_then(|bytes| {
        if !claim_there {
            return Err(std::io::Error::other(format!(
                "persistentvolumeclaim {} was deleted meanwhile",
                quoted(&claim)
            )));
        }
        remove(&to);
        std::fs::rename(&tmp, &to)?;
        Ok(bytes)
    });
    let bytes = match published {
        Ok(b) => b,
        Err(e) => {
            drop(s);
            remove(&tmp);
            let message = format!(
                "Failed to check and update snapshot content: failed to take snapshot of the volume {claim}: {}",
                quoted(&e.to_string())
            );
            return fail(&store, &key, &uid, "SnapshotCreationFailed", &message);
        }
    };
    if snapshot["spec"]["volumeSnapshotClassName"].is_null() {
        snapshot["spec"]["volumeSnapshotClassName"] = json!(class);
    }
    snapshot["status"] = json!({
        "readyToUse": true,
        "restoreSize": bytes.to_string(),
        "creationTime": now(),
        "boundVolumeSnapshotContentName": format!("snapcontent-{uid}"),
    });
    s.commit(&key, "MODIFIED", snapshot);
    let waiting: Vec<Key> = s
        .objects
        .iter()
        .filter(|(k, o)| {
            k.0 == "persistentvolumeclaims"
                && k.1 == ns
                && o["status"]["phase"] == "Pending"
                && source_of(o).as_deref() == Some(name)
        })
        .map(|(k, _)| k.clone())
        .collect();
    drop(s);
    let about = json!({"kind": "VolumeSnapshot", "name": name, "namespace": ns, "uid": uid});
    let ready = format!("Snapshot {ns}/{name} is ready to use.");
    crate::event(&store, ns, about, "Normal", "SnapshotReady", &ready);
    for claim in waiting {
        tokio::spawn(provision(Arc::clone(&store), claim));
    }
}

/// Record that VolumeSnapshot `key` (of `uid`, if still there) cannot be
/// taken: `readyToUse: false`, the error in its status and an event.
fn fail(store: &Arc<Mutex<Store>>, key: &Key, uid: &str, reason: &str, message: &str) {
    let mut s = store.lock().unwrap();
    let Some(mut snapshot) = s.objects.get(key).filter(|o| uid_of(o) == uid).cloned() else {
        return;
    };
    snapshot["status"] = json!({
        "readyToUse": false,
        "error": {"message": message, "time": now()},
    });
    s.commit(key, "MODIFIED", snapshot);
    drop(s);
    let about = json!({"kind": "VolumeSnapshot", "name": key.2, "namespace": key.1, "uid": uid});
    crate::event(store, &key.1, about, "Warning", reason, message);
}

/// Fill claim `key`, `Pending`, from its VolumeSnapshot a step after it
/// was made and bind it, as the CSI provisioner does; a snapshot missing
/// or not ready leaves it `Pending` with a `ProvisioningFailed` event.
pub(crate) async fn provision(store: Arc<Mutex<Store>>, key: Key) {
    tokio::time::sleep(POD_STEP).await;
    let (ns, name) = (key.1.as_str(), key.2.as_str());
    let (uid, class, source, plan) = {
        let mut s = store.lock().unwrap();
        let Some(claim) = s.objects.get(&key) else {
            return;
        };
        let Some(source) = source_of(claim).filter(|_| claim["status"]["phase"] == "Pending")
        else {
            return;
        };
        let uid = uid_of(claim);
        let class = claim["spec"]["storageClassName"].as_str().unwrap_or("");
        let class = class.to_owned();
        let snapshot = valid_name(&source)
            .then(|| s.objects.get(&self::key("volumesnapshots", ns, &source)))
            .flatten();
        let plan = match snapshot {
            None => Err(format!(
                "error getting snapshot {source} from api server: \
                 volumesnapshots.snapshot.storage.k8s.io {} not found",
                quoted(&source)
            )),
            Some(v) if v["status"]["readyToUse"] != true => {
                Err(format!("snapshot {source} is not Ready"))
            }
            Some(v) => Ok(uid_of(v)),
        };
        s.uid += 1;
        let tmp = s
            .root
            .join(ns)
            .join("pvc")
            .join(format!(".{name}.{}", s.uid));
        let plan = plan.map(|snap_uid| (snap_uid, snapshot_dir(&s.root, ns, &source), tmp));
        (uid, class, source, plan)
    };
    let about = json!({"kind": "PersistentVolumeClaim", "name": name, "namespace": ns, "uid": uid});
    let failed = |why: &str| {
        let message = format!(
            "failed to provision volume with StorageClass {}: error getting handle for \
             DataSource Type VolumeSnapshot by Name {source}: {why}",
            quoted(&class)
        );
        crate::event(
            &store,
            ns,
            about.clone(),
            "Warning",
            "ProvisioningFailed",
            &message,
        );
    };
    let (snap_uid, from, tmp) = match plan {
        Ok(p) => p,
        Err(why) => return failed(&why),
    };
    let copied = copy_off_thread(&from, &tmp).await;
    let mut s = store.lock().unwrap();
    let Some(mut claim) = s
        .objects
        .get(&key)
        .filter(|c| uid_of(c) == uid && c["status"]["phase"] == "Pending")
        .cloned()
    else {
        drop(s);
        return remove(&tmp);
    };
    // The snapshot may have gone while it was copied.
    let snapshot_there = s
        .objects
        .get(&self::key("volumesnapshots", ns, &source))
        .is_some_and(|v| uid_of(v) == snap_uid);
    let to = claim_dir(&s.root, ns, name);
    let published = copied.and_then(|_| {
        if !snapshot_there {
            return Err(std::io::Error::other(format!(
                "volumesnapshots.snapshot.storage.k8s.io {} not found",
                quoted(&source)
            )));
        }
        remove(&to);
        std::fs::rename(&tmp, &to)
    });
    if let Err(e) = published {
        drop(s);
        remove(&tmp);
        return failed(&e.to_string());
    }
    claim["status"] = json!({"phase": "Bound"});
    s.commit(&key, "MODIFIED", claim);
    drop(s);
    let message = format!("Successfully provisioned volume pvc-{uid}");
    crate::event(
        &store,
        ns,
        about,
        "Normal",
        "ProvisioningSucceeded",
        &message,
    );
}

/// Wait until every claim Pod `key` mounts is there and `Bound`, as the
/// scheduler does: meanwhile the Pod is `Pending` with a `PodScheduled`
/// condition that says why, and a `FailedScheduling` event. False when the
/// Pod is gone or being deleted first.
pub(crate) async fn schedule(store: &Arc<Mutex<Store>>, key: &Key) -> bool {
    let mut told = false;
    loop {
        let why = {
            let mut s = store.lock().unwrap();
            let Some(mut pod) = s.objects.get(key).cloned() else {
                return false;
            };
            if pod["metadata"]["deletionTimestamp"].is_string() {
                return false;
            }
            match unschedulable(&s, &key.1, &pod) {
                None => return true,
                Some(why) if !told => {
                    pod["status"] = json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                        "status": "False", "reason": "Unschedulable", "message": why}]});
                    s.commit(key, "MODIFIED", pod);
                    Some(why)
                }
                Some(_) => None,
            }
        };
        if let Some(why) = why {
            told = true;
            crate::pod_event_of(store, &key.1, &key.2, "Warning", "FailedScheduling", &why);
        }
        tokio::time::sleep(POD_STEP).await;
    }
}

/// Why Pod `pod` in `namespace` cannot be scheduled yet, as the scheduler
/// says it: a claim of its volumes is missing or not bound.
fn unschedulable(s: &Store, namespace: &str, pod: &Value) -> Option<String> {
    pod["spec"]["volumes"].as_array()?.iter().find_map(|v| {
        let claim = v["persistentVolumeClaim"]["claimName"].as_str()?;
        match s
            .objects
            .get(&key("persistentvolumeclaims", namespace, claim))
        {
            None => Some(format!(
                "0/1 nodes are available: persistentvolumeclaim \"{claim}\" not found."
            )),
            Some(c) if c["status"]["phase"] != "Bound" => Some(
                "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
                    .to_owned(),
            ),
            Some(_) => None,
        }
    })
}

/// [`copy`] on a blocking thread.
async fn copy_off_thread(from: &Path, to: &Path) -> std::io::Result<u64> {
    let (from, to) = (from.to_owned(), to.to_owned());
    tokio::task::spawn_blocking(move || copy(&from, &to))
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
}

/// Copy directory `from` (an empty one when it is not a directory) to
/// `to`, which does not exist yet, keeping modes, owners, times and
/// symlinks as they are, none followed, as root of a user namespace (so
/// that files their owner may not read are copied too); the copy's bytes.
fn copy(from: &Path, to: &Path) -> std::io::Result<u64> {
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let is_dir = from.symlink_metadata().is_ok_and(|m| m.is_dir());
    let script = "if [ -n \"$1\" ]; then cp -a --reflink=auto -T -- \"$1\" \"$2\"; \
                  else mkdir -m 0755 -- \"$2\"; fi && du -s -b -- \"$2\"";
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "sh", "-c", script, "sh"])
        .arg(if is_dir {
            from.as_os_str()
        } else {
            OsStr::new("")
        })
        .arg(to)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(std::io::Error::other(format!(
            "copy: {}",
            err.lines().next().unwrap_or("failed")
        )));
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| std::io::Error::other("copy: no size"))
}

/// Remove `dir` and all in it (nothing when it is not there), as root of
/// a user namespace when its owner alone cannot (a directory without
/// write permission).
pub(crate) fn remove(dir: &Path) {
    if std::fs::remove_dir_all(dir).is_err() && dir.symlink_metadata().is_ok() {
        let _ = Command::new("unshare")
            .args(["--user", "--map-root-user", "rm", "-rf", "--"])
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Now, in RFC 3339 (UTC, to the second).
fn now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // The civil date of a day number (Howard Hinnant's days_from_civil,
    // inverted).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_messages_and_copies_read_as_a_cluster_s() {
        let claim = json!({"spec": {"dataSource": {"apiGroup": GROUP, "kind": "VolumeSnapshot",
                                                   "name": "s1"}}});
        assert_eq!(source_of(&claim).as_deref(), Some("s1"));
        let by_ref = json!({"spec": {"dataSourceRef": {"apiGroup": GROUP, "kind": "VolumeSnapshot",
                                                       "name": "s2"}}});
        assert_eq!(source_of(&by_ref).as_deref(), Some("s2"));
        let clone = json!({"spec": {"dataSource": {"kind": "PersistentVolumeClaim", "name": "c"}}});
        assert_eq!(source_of(&clone), None);
        assert_eq!(
            quoted("persistentvolumeclaim \"p\" not found"),
            r#""persistentvolumeclaim \"p\" not found""#
        );
        let source = json!({"spec": {"source": {}}});
        assert!(invalid("volumesnapshots", "ns", "s", &source).is_some());
        assert!(invalid("pods", "ns", "..", &json!({})).is_some());
        assert!(invalid("pods", "..", "p", &json!({})).is_some());
        assert!(invalid("pods", "ns", "a/b", &json!({})).is_some());
        assert!(invalid("volumesnapshotclasses", "", "c.d-1", &json!({})).is_none());
        let source = json!({"spec": {"source": {"persistentVolumeClaimName": "p"}}});
        assert!(invalid("volumesnapshots", "ns", "s", &source).is_none());
        assert!(invalid("pods", "ns", "p", &json!({})).is_none());
        let now = now();
        assert_eq!(now.len(), "2026-01-01T00:00:00Z".len(), "{now}");
        assert!(now.starts_with("20"), "{now}");

        // A copy keeps modes and symlinks, follows none, and reads what
        // its owner may not.
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("from");
        std::fs::create_dir_all(from.join("sub")).unwrap();
        std::fs::write(from.join("sub/f"), "12345").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", from.join("link")).unwrap();
        std::fs::write(from.join("secret"), "s").unwrap();
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(m)).unwrap();
        };
        mode(&from.join("secret"), 0o000);
        let to = dir.path().join("snap/to");
        assert!(copy(&from, &to).unwrap() >= 6);
        assert_eq!(std::fs::read_to_string(to.join("sub/f")).unwrap(), "12345");
        assert_eq!(
            std::fs::read_link(to.join("link")).unwrap(),
            Path::new("/etc/hostname")
        );
        let meta = std::fs::symlink_metadata(to.join("secret")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0
        );
        // A claim never mounted: an empty copy.
        let empty = dir.path().join("snap/empty");
        copy(&dir.path().join("none"), &empty).unwrap();
        assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
        // Removed even where its owner may not write.
        mode(&to.join("sub"), 0o500);
        remove(&to);
        assert!(!to.exists());
    }
}
