//! How much host memory this process can still allocate, for the capacity
//! check of the weights pipeline ([`crate::pipeline`]).
//!
//! `MemAvailable` in `/proc/meminfo` is the node's: in a container (a
//! Kubernetes pod with a memory limit) the process is killed by its cgroup's
//! limit long before the node runs short. So the figure is the smaller of
//! `MemAvailable` and what the process's memory cgroup, and every cgroup
//! above it, leaves: the limit minus the usage, where the usage does not
//! count the page cache the kernel reclaims before it kills anything
//! (`active_file` and `inactive_file` of `memory.stat`; a worker that has
//! just read its checkpoint would otherwise see its own file cache as used).
//!
//! - cgroup v2: the line `0::/path` of `/proc/self/cgroup`, under
//!   `/sys/fs/cgroup`: `memory.max` (`max` is no limit), `memory.current`,
//!   `memory.stat`.
//! - cgroup v1: the line naming the `memory` controller, under
//!   `/sys/fs/cgroup/memory`: `memory.limit_in_bytes`,
//!   `memory.usage_in_bytes`, `memory.stat` (`total_active_file`,
//!   `total_inactive_file`).
//!
//! A container without its own cgroup namespace sees its host-side path in
//! `/proc/self/cgroup` while its own cgroup is mounted at the root of the
//! hierarchy: a path that does not exist under the mount is read at the
//! mount's root. Anything missing or unreadable leaves that level (or the
//! whole figure) unknown, never a refusal: the check refuses only what is
//! known not to fit. Every path is under `root` (`/` outside the tests).

use std::io::Read;
use std::path::{Component, Path, PathBuf};

/// The most bytes read of any one file of `/proc` or `/sys` here.
const MAX_FILE_BYTES: u64 = 1 << 16;

fn read_small(path: &Path) -> Option<String> {
    let file = std::fs::File::open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES).read_to_string(&mut text).ok()?;
    Some(text)
}

fn number(path: &Path) -> Option<u64> {
    read_small(path)?.trim().parse().ok()
}

/// The value of `key` in a `key value` file (`memory.stat`).
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut parts = l.split_whitespace();
        (parts.next() == Some(key))
            .then(|| parts.next()?.parse().ok())
            .flatten()
    })
}

/// The host's `MemAvailable` in bytes, when `<root>/proc/meminfo` says.
pub fn meminfo_available(root: &Path) -> Option<u64> {
    let text = read_small(&root.join("proc/meminfo"))?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The memory the cgroups of this process leave it (the smallest over its
/// cgroup and those above it, v2 and v1 alike), when any sets a limit.
pub fn cgroup_available(root: &Path) -> Option<u64> {
    let text = read_small(&root.join("proc/self/cgroup"))?;
    let mut best: Option<u64> = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let left = if controllers.is_empty() {
            walk(&root.join("sys/fs/cgroup"), path, v2_left)
        } else if controllers.split(',').any(|c| c == "memory") {
            walk(&root.join("sys/fs/cgroup/memory"), path, v1_left)
        } else {
            continue;
        };
        best = min_known(best, left);
    }
    best
}

/// What this process can allocate: the smaller of [`meminfo_available`] and
/// [`cgroup_available`], when either is known.
pub fn available(root: &Path) -> Option<u64> {
    min_known(meminfo_available(root), cgroup_available(root))
}

fn min_known(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The smallest of `left` over the cgroup `path` under `mount` and each of
/// its ancestors up to the mount (the hierarchy's root).
fn walk(mount: &Path, path: &str, left: fn(&Path) -> Option<u64>) -> Option<u64> {
    let relative: Option<PathBuf> = Path::new(path)
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    // A path the kernel would not write (`..`): only the mount's root.
    let relative = relative.unwrap_or_default();
    let mut dir = mount.join(&relative);
    if !dir.is_dir() {
        // No cgroup namespace: the process's own cgroup is the mount's root.
        dir = mount.to_owned();
    }
    let mut best = None;
    loop {
        best = min_known(best, left(&dir));
        if dir.as_path() == mount {
            return best;
        }
        match dir.parent() {
            Some(up) if up.starts_with(mount) => dir = up.to_owned(),
            _ => return best,
        }
    }
}

/// A v2 cgroup's `memory.max` minus its usage (`memory.current` less the
/// reclaimable file cache); `None` without a limit.
fn v2_left(dir: &Path) -> Option<u64> {
    let max = read_small(&dir.join("memory.max"))?;
    let max = max.trim();
    if max == "max" {
        return None;
    }
    let limit: u64 = max.parse().ok()?;
    let usage = number(&dir.join("memory.current"));
    let stat = read_small(&dir.join("memory.stat")).unwrap_or_default();
    let cache = stat_value(&stat, "active_file")
        .unwrap_or(0)
        .saturating_add(stat_value(&stat, "inactive_file").unwrap_or(0));
    Some(left_of(limit, usage, cache))
}

/// A v1 cgroup's `memory.limit_in_bytes` minus its usage
/// (`memory.usage_in_bytes` less the reclaimable file cache).
fn v1_left(dir: &Path) -> Option<u64> {
    let limit = number(&dir.join("memory.limit_in_bytes"))?;
    let usage = number(&dir.join("memory.usage_in_bytes"));
    let stat = read_small(&dir.join("memory.stat")).unwrap_or_default();
    let file = |k: &str| {
        stat_value(&stat, &format!("total_{k}"))
            .or_else(|| stat_value(&stat, k))
            .unwrap_or(0)
    };
    let cache = file("active_file").saturating_add(file("inactive_file"));
    Some(left_of(limit, usage, cache))
}

/// The limit minus the usage that is not reclaimable cache; with the usage
/// unknown, the limit itself (no process can have more).
fn left_of(limit: u64, usage: Option<u64>, cache: u64) -> u64 {
    match usage {
        Some(usage) => limit.saturating_sub(usage.saturating_sub(cache)),
        None => limit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn put(root: &Path, path: &str, text: &str) {
        let p = root.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn meminfo(root: &Path, available_kib: u64) {
        put(
            root,
            "proc/meminfo",
            &format!("MemTotal:       65536000 kB\nMemFree:         1000 kB\nMemAvailable:   {available_kib} kB\n"),
        );
    }

    #[test]
    fn without_a_cgroup_the_node_figure_is_taken() {
        let d = tempfile::tempdir().unwrap();
        meminfo(d.path(), 8 << 20);
        assert_eq!(available(d.path()), Some(8 * GIB));
        // No meminfo either: unknown, so nothing is refused.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(available(empty.path()), None);
    }

    #[test]
    fn a_v2_limit_below_the_node_figure_wins_and_reclaimable_cache_is_not_usage() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        meminfo(r, 64 << 20);
        put(r, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
        put(
            r,
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max",
            "4294967296\n",
        );
        put(
            r,
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.current",
            "3221225472\n",
        );
        put(
            r,
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.stat",
            "anon 1073741824\nactive_file 536870912\ninactive_file 536870912\nshmem 0\n",
        );
        // 4 GiB limit, 3 GiB charged of which 1 GiB is file cache: 2 GiB left.
        assert_eq!(cgroup_available(r), Some(2 * GIB));
        assert_eq!(available(r), Some(2 * GIB));
        // The pod's own limit above the container's is lower still.
        put(r, "sys/fs/cgroup/kubepods/pod1/memory.max", "2684354560\n");
        put(
            r,
            "sys/fs/cgroup/kubepods/pod1/memory.current",
            "2147483648\n",
        );
        assert_eq!(cgroup_available(r), Some(GIB / 2));
        // "max" at a level is no limit there.
        put(r, "sys/fs/cgroup/kubepods/pod1/memory.max", "max\n");
        assert_eq!(cgroup_available(r), Some(2 * GIB));
    }

    #[test]
    fn a_v2_cgroup_without_a_namespace_is_read_at_the_mount_root() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        meminfo(r, 64 << 20);
        // The host-side path, absent from the container's mount.
        put(r, "proc/self/cgroup", "0::/system.slice/docker-abc.scope\n");
        put(r, "sys/fs/cgroup/memory.max", "1073741824\n");
        put(r, "sys/fs/cgroup/memory.current", "0\n");
        assert_eq!(available(r), Some(GIB));
    }

    #[test]
    fn v1_limits_are_read_from_the_memory_controller() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        meminfo(r, 64 << 20);
        put(
            r,
            "proc/self/cgroup",
            "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n1:name=systemd:/docker/abc\n",
        );
        put(
            r,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes",
            "3221225472\n",
        );
        put(
            r,
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes",
            "2147483648\n",
        );
        put(
            r,
            "sys/fs/cgroup/memory/docker/abc/memory.stat",
            "cache 1\ninactive_file 5\ntotal_active_file 0\ntotal_inactive_file 1073741824\n",
        );
        assert_eq!(available(r), Some(2 * GIB));
        // v1's "unlimited" is a huge number: the node's figure wins.
        put(
            r,
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        assert_eq!(available(r), Some(64 * GIB));
    }

    #[test]
    fn missing_files_and_garbage_leave_the_figure_unknown_not_refused() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        meminfo(r, 16 << 20);
        // A cgroup line but no cgroup files at all.
        put(r, "proc/self/cgroup", "0::/a/b\n");
        assert_eq!(cgroup_available(r), None);
        assert_eq!(available(r), Some(16 * GIB));
        // Garbage limits are no limit.
        put(r, "sys/fs/cgroup/a/b/memory.max", "lots\n");
        assert_eq!(cgroup_available(r), None);
        // A limit without its usage bounds by the limit alone.
        put(r, "sys/fs/cgroup/a/b/memory.max", "1073741824\n");
        assert_eq!(cgroup_available(r), Some(GIB));
        // Garbage usage and stat are read as unknown / no cache.
        put(r, "sys/fs/cgroup/a/b/memory.current", "-5\n");
        put(r, "sys/fs/cgroup/a/b/memory.stat", "active_file x\n\n:::\n");
        assert_eq!(cgroup_available(r), Some(GIB));
        // Usage above the limit leaves nothing (not an underflow).
        put(r, "sys/fs/cgroup/a/b/memory.current", "2147483648\n");
        assert_eq!(cgroup_available(r), Some(0));
        // Garbage /proc/self/cgroup lines and a path escaping the mount.
        put(r, "proc/self/cgroup", "garbage\n::\n0::/../../etc\n");
        put(r, "sys/fs/cgroup/memory.max", "max\n");
        assert_eq!(cgroup_available(r), None);
        // Garbage meminfo: only the cgroup's figure, if any.
        put(r, "proc/meminfo", "MemAvailable: many kB\n");
        assert_eq!(meminfo_available(r), None);
    }

    #[test]
    fn this_machine_gives_a_figure_no_larger_than_the_node_one() {
        let root = Path::new("/");
        if let (Some(node), Some(all)) = (meminfo_available(root), available(root)) {
            assert!(all <= node);
        }
    }
}
