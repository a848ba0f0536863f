//! How much memory the server may use: the host's physical memory, or less when the server
//! runs in a control group with a memory limit (a container, a systemd unit with
//! `MemoryMax=`). The WAL cache is capped at a quarter of it (`capped_cache_pages`): pages
//! it locks cannot be evicted, and inside a container the kernel's OOM killer acts at the
//! cgroup's limit, not at the host's RAM.
//!
//! `usable_memory` reads `/proc/self/cgroup` and the limits under `/sys/fs/cgroup`; the work
//! is done by `usable_memory_in` and `cgroup_memory_limit`, which take the cgroup root
//! directory and the text of `/proc/self/cgroup` as parameters, so that tests can point them
//! at a made-up hierarchy.
//!
//! - cgroup v2: the line `0::/path`; the limit is `memory.max` of that cgroup and of each of
//!   its ancestors up to the root (`max` means no limit). The host's root cgroup has no
//!   `memory.max`; in a cgroup namespace (the usual container) the path is `/` and the root
//!   of the mounted hierarchy is the container's own cgroup, with its own `memory.max`.
//! - cgroup v1: the line whose controller list holds `memory`; the limit is
//!   `memory.limit_in_bytes` under `<root>/memory/path` and its ancestors. No limit reads as
//!   i64::MAX rounded down to a page (9223372036854771712 with 4 kB pages).
//!
//! The smallest limit found anywhere wins. Missing directories or files and unreadable or
//! malformed contents are skipped: they never make the limit smaller, and never panic.
//! Walking up to the root also covers containers without a cgroup namespace whose
//! `/sys/fs/cgroup` shows only their own cgroup at the root while `/proc/self/cgroup` still
//! names the host's path.
//!
//! `free_memory` says how much more the page cache can grow before the kernel has to evict
//! something: MemFree from `/proc/meminfo`, or less when a cgroup's limit less its usage
//! (`memory.current`, v1 `memory.usage_in_bytes`, page cache included) is smaller, for the
//! process's cgroups and their ancestors. `free_memory_in` does the work on given texts and
//! paths, for the same made-up hierarchies.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where the cgroup hierarchies are mounted (v2 unified; v1 has one directory per controller,
/// `memory` among them).
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The process's cgroup membership, one line per hierarchy.
pub const PROC_SELF_CGROUP: &str = "/proc/self/cgroup";

/// Limits from this value up mean "no limit": cgroup v1 reports an unlimited cgroup as
/// i64::MAX rounded down to the page size (which depends on the kernel), and no machine has
/// an exbibyte of memory.
pub const UNLIMITED_FROM: u64 = 1 << 60;

/// The file a limit is read from is never longer than this; anything longer is not a limit.
const MAX_LIMIT_FILE_LEN: u64 = 64;

/// The kernel's memory counters.
pub const PROC_MEMINFO: &str = "/proc/meminfo";

/// `/proc/meminfo` is about 1.5 kB; only this much of it is read.
const MAX_MEMINFO_LEN: u64 = 64 * 1024;

/// A memory-limiting cgroup hierarchy the process belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hierarchy {
    /// The unified hierarchy (`0::/path`), limit in `memory.max`.
    V2,
    /// The v1 `memory` controller's hierarchy, limit in `memory.limit_in_bytes`.
    V1Memory,
}

impl Hierarchy {
    /// The directory under the cgroup root where this hierarchy is mounted.
    fn mount(self, cgroup_root: &Path) -> PathBuf {
        match self {
            Hierarchy::V2 => cgroup_root.to_path_buf(),
            Hierarchy::V1Memory => cgroup_root.join("memory"),
        }
    }

    /// The file that holds a cgroup's memory limit.
    fn limit_file(self) -> &'static str {
        match self {
            Hierarchy::V2 => "memory.max",
            Hierarchy::V1Memory => "memory.limit_in_bytes",
        }
    }

    /// The file that holds a cgroup's current memory usage (page cache included).
    fn usage_file(self) -> &'static str {
        match self {
            Hierarchy::V2 => "memory.current",
            Hierarchy::V1Memory => "memory.usage_in_bytes",
        }
    }
}

/// Bytes of memory the server may use: `physical_memory` (the host's RAM, 0 if unknown), or
/// the smallest cgroup memory limit that applies to this process if that is smaller. 0 when
/// neither is known.
pub fn usable_memory(physical_memory: u64) -> u64 {
    let proc_self_cgroup = std::fs::read_to_string(PROC_SELF_CGROUP).unwrap_or_default();
    usable_memory_in(physical_memory, Path::new(CGROUP_ROOT), &proc_self_cgroup)
}

/// `usable_memory` with the cgroup root directory and the text of `/proc/self/cgroup` given.
pub fn usable_memory_in(physical_memory: u64, cgroup_root: &Path, proc_self_cgroup: &str) -> u64 {
    match cgroup_memory_limit(cgroup_root, proc_self_cgroup) {
        Some(limit) if physical_memory == 0 || limit < physical_memory => limit,
        _ => physical_memory,
    }
}

/// The smallest memory limit, in bytes, of the cgroups named in `proc_self_cgroup` (the text
/// of `/proc/self/cgroup`) and of their ancestors, read under `cgroup_root`; None when no
/// limit is set (or none could be read).
pub fn cgroup_memory_limit(cgroup_root: &Path, proc_self_cgroup: &str) -> Option<u64> {
    memory_cgroups(proc_self_cgroup)
        .into_iter()
        .filter_map(|(hierarchy, path)| {
            smallest_limit_up_to_root(&hierarchy.mount(cgroup_root), path, hierarchy.limit_file())
        })
        .min()
}

/// The memory-limiting cgroups in `/proc/self/cgroup`'s text, with their paths: the v2 line
/// (`0::/path`) and the v1 line whose controllers include `memory`
/// (`hierarchy-id:controller,...:/path`). Other lines, and malformed ones, are left out.
pub fn memory_cgroups(proc_self_cgroup: &str) -> Vec<(Hierarchy, &str)> {
    proc_self_cgroup
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let hierarchy = if id == "0" && controllers.is_empty() {
                Hierarchy::V2
            } else if id.parse::<u32>().is_ok() && controllers.split(',').any(|c| c == "memory") {
                Hierarchy::V1Memory
            } else {
                return None;
            };
            path.starts_with('/').then_some((hierarchy, path))
        })
        .collect()
}

/// The directories of the cgroup at `path` (as `/proc/self/cgroup` gives it) under the
/// hierarchy mounted at `mount` and of each of its ancestors, from the hierarchy's root
/// down. A path that leaves its root (`..`, shown for a cgroup outside the process's cgroup
/// namespace) gives None: the files visible here are not that cgroup's.
fn cgroup_dirs_up_to_root(mount: &Path, path: &str) -> Option<Vec<PathBuf>> {
    let components: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if components.contains(&"..") {
        return None;
    }
    Some(
        (0..=components.len())
            .map(|depth| {
                let mut dir = mount.to_path_buf();
                dir.extend(&components[..depth]);
                dir
            })
            .collect(),
    )
}

/// The smallest limit in `file` of the cgroup at `path` and of each of its ancestors up to
/// and including the hierarchy's root (`cgroup_dirs_up_to_root`).
fn smallest_limit_up_to_root(mount: &Path, path: &str, file: &str) -> Option<u64> {
    cgroup_dirs_up_to_root(mount, path)?
        .iter()
        .filter_map(|dir| read_limit(&dir.join(file)))
        .min()
}

/// A small file's text; None when it is missing, unreadable or longer than a counter file.
fn read_small_file(file: &Path) -> Option<String> {
    let mut text = String::new();
    File::open(file)
        .ok()?
        .take(MAX_LIMIT_FILE_LEN + 1)
        .read_to_string(&mut text)
        .ok()?;
    (text.len() as u64 <= MAX_LIMIT_FILE_LEN).then_some(text)
}

/// The limit in a `memory.max` or `memory.limit_in_bytes` file; None when it is missing,
/// unreadable, or says there is no limit.
fn read_limit(file: &Path) -> Option<u64> {
    parse_limit(&read_small_file(file)?)
}

/// Bytes of memory that can still be filled before the kernel evicts anything: MemFree, or
/// the smallest headroom (limit less usage) of the process's cgroups and their ancestors if
/// smaller. Reads `/proc/meminfo`, `/proc/self/cgroup` and the files under `/sys/fs/cgroup`;
/// None when neither MemFree nor a cgroup's headroom could be read.
pub fn free_memory() -> Option<u64> {
    let mut meminfo = String::new();
    if let Ok(file) = File::open(PROC_MEMINFO) {
        // An unreadable file leaves MemFree unknown, as an empty one does.
        let _ = file.take(MAX_MEMINFO_LEN).read_to_string(&mut meminfo);
    }
    let proc_self_cgroup = std::fs::read_to_string(PROC_SELF_CGROUP).unwrap_or_default();
    free_memory_in(&meminfo, Path::new(CGROUP_ROOT), &proc_self_cgroup)
}

/// `free_memory` with the text of `/proc/meminfo`, the cgroup root directory and the text of
/// `/proc/self/cgroup` given.
pub fn free_memory_in(meminfo: &str, cgroup_root: &Path, proc_self_cgroup: &str) -> Option<u64> {
    let free = parse_mem_free(meminfo);
    match (free, cgroup_headroom(cgroup_root, proc_self_cgroup)) {
        (Some(free), Some(headroom)) => Some(free.min(headroom)),
        (free, headroom) => free.or(headroom),
    }
}

/// MemFree from the text of `/proc/meminfo` (`MemFree:   123456 kB`), in bytes; None when
/// the line is missing or malformed.
pub fn parse_mem_free(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemFree:"))?;
    let mut fields = line.split_whitespace();
    let kilobytes = fields.next()?.parse::<u64>().ok()?;
    match (fields.next(), fields.next()) {
        (Some("kB"), None) => kilobytes.checked_mul(1024),
        _ => None,
    }
}

/// The smallest headroom (memory limit less current usage, 0 when the usage is over the
/// limit) of the memory-limiting cgroups named in `proc_self_cgroup` and of their
/// ancestors; None when no cgroup has both a limit and a usage that could be read.
pub fn cgroup_headroom(cgroup_root: &Path, proc_self_cgroup: &str) -> Option<u64> {
    memory_cgroups(proc_self_cgroup)
        .into_iter()
        .filter_map(|(hierarchy, path)| {
            cgroup_dirs_up_to_root(&hierarchy.mount(cgroup_root), path)?
                .iter()
                .filter_map(|dir| {
                    let limit = read_limit(&dir.join(hierarchy.limit_file()))?;
                    let usage = parse_usage(&read_small_file(&dir.join(hierarchy.usage_file()))?)?;
                    Some(limit.saturating_sub(usage))
                })
                .min()
        })
        .min()
}

/// A usage file's contents (`memory.current`, `memory.usage_in_bytes`): a number of bytes.
pub fn parse_usage(text: &str) -> Option<u64> {
    text.trim().parse::<u64>().ok()
}

/// A memory limit file's contents: a number of bytes, or `max` (v2) or a huge number (v1)
/// for no limit. Zero and anything malformed count as no limit: a limit of 0 would leave the
/// process nothing, so it is not what the file means.
pub fn parse_limit(text: &str) -> Option<u64> {
    let bytes = text.trim().parse::<u64>().ok()?;
    (bytes > 0 && bytes < UNLIMITED_FROM).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const GB: u64 = 1 << 30;
    const MB: u64 = 1 << 20;
    /// What cgroup v1 reports for "no limit" with 4 kB and with 64 kB pages.
    const V1_UNLIMITED_4K: &str = "9223372036854771712\n";
    const V1_UNLIMITED_64K: &str = "9223372036854710272\n";

    /// A directory under the system's temporary directory, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ccm-walcache-memory-{}-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed),
                name
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }

        /// Writes `contents` to `relative` (creating its directories).
        fn write(&self, relative: &str, contents: impl AsRef<[u8]>) {
            let file = self.0.join(relative);
            fs::create_dir_all(file.parent().unwrap()).unwrap();
            fs::write(file, contents).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn limit_files_are_parsed() {
        assert_eq!(parse_limit("1073741824\n"), Some(GB));
        assert_eq!(parse_limit("  536870912  "), Some(512 * MB));
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit(V1_UNLIMITED_4K), None);
        assert_eq!(parse_limit(V1_UNLIMITED_64K), None);
        assert_eq!(parse_limit(&format!("{}", i64::MAX)), None);
        assert_eq!(parse_limit(&format!("{}", u64::MAX)), None);
        assert_eq!(parse_limit("0\n"), None);
        assert_eq!(parse_limit("-1\n"), None);
        assert_eq!(parse_limit(""), None);
        assert_eq!(parse_limit("1G"), None);
        assert_eq!(parse_limit("18446744073709551616"), None);
    }

    #[test]
    fn proc_self_cgroup_is_parsed() {
        let text = "12:memory:/docker/abc\n\
                    11:cpu,cpuacct:/docker/abc\n\
                    1:name=systemd:/docker/abc\n\
                    0::/docker/abc\n";
        assert_eq!(
            memory_cgroups(text),
            vec![
                (Hierarchy::V1Memory, "/docker/abc"),
                (Hierarchy::V2, "/docker/abc")
            ]
        );
        // memory co-mounted with another controller; a path holding a colon.
        assert_eq!(
            memory_cgroups("4:cpu,memory:/a:b\n"),
            vec![(Hierarchy::V1Memory, "/a:b")]
        );
        assert_eq!(memory_cgroups("0::/\n"), vec![(Hierarchy::V2, "/")]);
        // Neither memory nor v2, or malformed.
        for text in [
            "",
            "\n\n",
            "3:cpuset:/x",
            "3:memoryx:/x",
            "x:memory:/x",
            "0:memory",
            "0::relative",
            "1::/x",
            "nonsense",
            "::::",
        ] {
            assert_eq!(memory_cgroups(text), vec![], "{text:?}");
        }
    }

    #[test]
    fn v2_limit_at_the_leaf() {
        let root = TempDir::new("v2-leaf");
        root.write("system.slice/memory.max", "max\n");
        root.write("system.slice/postgresql.service/memory.max", "1073741824\n");
        let proc = "0::/system.slice/postgresql.service\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(GB));
        assert_eq!(usable_memory_in(16 * GB, root.path(), proc), GB);
        // A host with less RAM than the limit: the RAM wins.
        assert_eq!(usable_memory_in(512 * MB, root.path(), proc), 512 * MB);
        // Unknown RAM: the limit is what is known.
        assert_eq!(usable_memory_in(0, root.path(), proc), GB);
        // The cap is a quarter of it.
        assert_eq!(
            crate::capped_cache_pages(
                4 * 1024 * 1024,
                usable_memory_in(16 * GB, root.path(), proc)
            ),
            GB / 4 / crate::WAL_PAGE
        );
    }

    #[test]
    fn v2_smaller_limit_at_an_ancestor() {
        let root = TempDir::new("v2-ancestor");
        root.write("machine.slice/memory.max", "2147483648\n");
        root.write("machine.slice/pod/memory.max", "max\n");
        root.write("machine.slice/pod/container/memory.max", "4294967296\n");
        let proc = "0::/machine.slice/pod/container\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(2 * GB));
        assert_eq!(usable_memory_in(64 * GB, root.path(), proc), 2 * GB);
    }

    #[test]
    fn v2_max_everywhere() {
        let root = TempDir::new("v2-max");
        // The host's root cgroup has no memory.max.
        root.write("memory.current", "123456\n");
        root.write("user.slice/memory.max", "max\n");
        root.write("user.slice/user-1000.slice/memory.max", "max\n");
        let proc = "0::/user.slice/user-1000.slice\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), None);
        assert_eq!(usable_memory_in(16 * GB, root.path(), proc), 16 * GB);
        // The process in the root cgroup itself.
        assert_eq!(cgroup_memory_limit(root.path(), "0::/\n"), None);
    }

    #[test]
    fn v2_in_a_cgroup_namespace_the_root_shows_the_containers_limit() {
        let root = TempDir::new("v2-namespace");
        root.write("memory.max", "536870912\n");
        assert_eq!(cgroup_memory_limit(root.path(), "0::/\n"), Some(512 * MB));
        assert_eq!(usable_memory_in(16 * GB, root.path(), "0::/\n"), 512 * MB);
        // The same container's processes in a child cgroup of its own.
        root.write("init/memory.max", "max\n");
        assert_eq!(
            cgroup_memory_limit(root.path(), "0::/init\n"),
            Some(512 * MB)
        );
        // A cgroup outside the namespace (shown with ..) is not judged by what is visible.
        assert_eq!(cgroup_memory_limit(root.path(), "0::/../other\n"), None);
    }

    #[test]
    fn v1_with_a_limit() {
        let root = TempDir::new("v1-limit");
        root.write("memory/memory.limit_in_bytes", V1_UNLIMITED_4K);
        root.write("memory/docker/memory.limit_in_bytes", V1_UNLIMITED_4K);
        root.write("memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
        // A v2 file at the same place must not be read for the v1 hierarchy.
        root.write("cpu,cpuacct/docker/abc/cpu.shares", "1024\n");
        let proc =
            "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(2 * GB));
        assert_eq!(usable_memory_in(16 * GB, root.path(), proc), 2 * GB);
    }

    #[test]
    fn v1_with_a_smaller_limit_at_an_ancestor() {
        let root = TempDir::new("v1-ancestor");
        root.write("memory/kubepods/memory.limit_in_bytes", "1073741824\n");
        root.write("memory/kubepods/pod/memory.limit_in_bytes", "4294967296\n");
        let proc = "9:memory:/kubepods/pod\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(GB));
    }

    #[test]
    fn v1_unlimited() {
        let root = TempDir::new("v1-unlimited");
        root.write("memory/memory.limit_in_bytes", V1_UNLIMITED_4K);
        root.write("memory/docker/abc/memory.limit_in_bytes", V1_UNLIMITED_64K);
        let proc = "12:memory:/docker/abc\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), None);
        assert_eq!(usable_memory_in(16 * GB, root.path(), proc), 16 * GB);
    }

    #[test]
    fn v1_container_without_a_cgroup_namespace_sees_its_limit_at_the_root() {
        // /proc/self/cgroup names the host's path, but the container's /sys/fs/cgroup/memory
        // is its own cgroup: the walk up reaches the root and finds the limit there.
        let root = TempDir::new("v1-no-namespace");
        root.write("memory/memory.limit_in_bytes", "805306368\n");
        let proc = "12:memory:/docker/0123456789abcdef\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(768 * MB));
    }

    #[test]
    fn hybrid_v1_and_v2_the_smallest_wins() {
        let root = TempDir::new("hybrid");
        root.write("memory/svc/memory.limit_in_bytes", "3221225472\n");
        root.write("unified/svc/cgroup.procs", "1\n");
        let proc = "7:memory:/svc\n0::/svc\n";
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(3 * GB));
        let root = TempDir::new("both");
        root.write("memory/svc/memory.limit_in_bytes", "3221225472\n");
        root.write("svc/memory.max", "1073741824\n");
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(GB));
    }

    #[test]
    fn no_cgroup_filesystem_leaves_the_host_memory() {
        let root = TempDir::new("missing");
        let missing = root.path().join("does-not-exist");
        for proc in [
            "0::/system.slice/postgresql.service\n",
            "12:memory:/docker/abc\n0::/\n",
            "",
        ] {
            assert_eq!(cgroup_memory_limit(&missing, proc), None, "{proc:?}");
            assert_eq!(cgroup_memory_limit(root.path(), proc), None, "{proc:?}");
            assert_eq!(usable_memory_in(16 * GB, &missing, proc), 16 * GB);
        }
        assert_eq!(usable_memory_in(0, &missing, "0::/\n"), 0);
    }

    #[test]
    fn garbage_is_ignored() {
        let root = TempDir::new("garbage");
        let proc = "0::/a/b\n";
        for contents in [
            &b"lots of garbage\n"[..],
            b"",
            b"\n",
            b"-1\n",
            b"0\n",
            b"1.5G\n",
            b"\xff\xfe\x00\x01",
            b"max max\n",
        ] {
            root.write("a/b/memory.max", contents);
            assert_eq!(cgroup_memory_limit(root.path(), proc), None, "{contents:?}");
            assert_eq!(usable_memory_in(16 * GB, root.path(), proc), 16 * GB);
        }
        // A number followed by more than a limit file ever holds.
        root.write("a/b/memory.max", format!("1073741824{}", " ".repeat(100)));
        assert_eq!(cgroup_memory_limit(root.path(), proc), None);
        // Garbage at the leaf does not hide a limit at an ancestor.
        root.write("a/b/memory.max", "garbage");
        root.write("a/memory.max", "1073741824\n");
        assert_eq!(cgroup_memory_limit(root.path(), proc), Some(GB));
        // A directory where the limit file should be.
        fs::remove_file(root.path().join("a/memory.max")).unwrap();
        fs::create_dir_all(root.path().join("a/memory.max")).unwrap();
        assert_eq!(cgroup_memory_limit(root.path(), proc), None);
        // Garbage in /proc/self/cgroup.
        root.write("memory.max", "1073741824\n");
        for text in [
            "garbage",
            "0::",
            "0::relative/path",
            "0::/../../escape",
            ":::\n::\n:\n",
            "\u{0}\u{ffff}",
        ] {
            assert_eq!(cgroup_memory_limit(root.path(), text), None, "{text:?}");
        }
        // A path with . and doubled slashes still names the same cgroups.
        assert_eq!(cgroup_memory_limit(root.path(), "0::/a//./b/\n"), Some(GB));
    }

    const MEMINFO: &str = "MemTotal:       24576000 kB\n\
                           MemFree:         8388608 kB\n\
                           MemAvailable:   20000000 kB\n\
                           Buffers:           12345 kB\n";

    #[test]
    fn mem_free_is_parsed() {
        assert_eq!(parse_mem_free(MEMINFO), Some(8 * GB));
        assert_eq!(parse_mem_free("MemFree: 0 kB\n"), Some(0));
        // MemAvailable is not MemFree, whatever the order.
        assert_eq!(
            parse_mem_free("MemAvailable: 100 kB\nMemFree: 1 kB\n"),
            Some(1024)
        );
        for text in [
            "",
            "MemTotal: 100 kB\n",
            "MemFree:\n",
            "MemFree: lots kB\n",
            "MemFree: 100\n",
            "MemFree: 100 MB\n",
            "MemFree: 100 kB extra\n",
            "MemFree: -1 kB\n",
            "MemFree: 18446744073709551615 kB\n",
            " MemFree: 100 kB\n",
        ] {
            assert_eq!(parse_mem_free(text), None, "{text:?}");
        }
    }

    #[test]
    fn free_memory_without_cgroup_limits_is_mem_free() {
        let root = TempDir::new("free-no-limit");
        root.write("memory.current", "123456\n");
        root.write("user.slice/memory.max", "max\n");
        root.write("user.slice/memory.current", "4294967296\n");
        let proc = "0::/user.slice\n";
        assert_eq!(cgroup_headroom(root.path(), proc), None);
        assert_eq!(free_memory_in(MEMINFO, root.path(), proc), Some(8 * GB));
        assert_eq!(free_memory_in("", root.path(), proc), None);
    }

    #[test]
    fn free_memory_v2_headroom_of_the_tightest_cgroup() {
        let root = TempDir::new("free-v2");
        // The leaf: 4 GB limit, 1 GB used (3 GB headroom).
        root.write("machine.slice/pod/container/memory.max", "4294967296\n");
        root.write("machine.slice/pod/container/memory.current", "1073741824\n");
        // The pod: no limit.
        root.write("machine.slice/pod/memory.max", "max\n");
        root.write("machine.slice/pod/memory.current", "3221225472\n");
        // The slice: 6 GB limit, 5 GB used by everything in it (1 GB headroom).
        root.write("machine.slice/memory.max", "6442450944\n");
        root.write("machine.slice/memory.current", "5368709120\n");
        let proc = "0::/machine.slice/pod/container\n";
        assert_eq!(cgroup_headroom(root.path(), proc), Some(GB));
        assert_eq!(free_memory_in(MEMINFO, root.path(), proc), Some(GB));
        // Less MemFree than any headroom: MemFree wins.
        assert_eq!(
            free_memory_in("MemFree: 1024 kB\n", root.path(), proc),
            Some(MB)
        );
        // No /proc/meminfo: the headroom is what is known.
        assert_eq!(free_memory_in("", root.path(), proc), Some(GB));
        // Over its limit (usage counts the page cache, which may exceed it briefly): none left.
        root.write("machine.slice/memory.current", "7516192768\n");
        assert_eq!(free_memory_in(MEMINFO, root.path(), proc), Some(0));
    }

    #[test]
    fn free_memory_a_limit_without_a_readable_usage_is_left_out() {
        let root = TempDir::new("free-no-usage");
        root.write("a/memory.max", "1073741824\n");
        root.write("a/b/memory.max", "4294967296\n");
        root.write("a/b/memory.current", "garbage\n");
        let proc = "0::/a/b\n";
        assert_eq!(cgroup_headroom(root.path(), proc), None);
        root.write("a/b/memory.current", "1073741824\n");
        assert_eq!(cgroup_headroom(root.path(), proc), Some(3 * GB));
        // Outside the namespace: nothing visible is that cgroup's.
        assert_eq!(cgroup_headroom(root.path(), "0::/../a/b\n"), None);
    }

    #[test]
    fn free_memory_v1_headroom() {
        let root = TempDir::new("free-v1");
        root.write("memory/memory.limit_in_bytes", V1_UNLIMITED_4K);
        root.write("memory/memory.usage_in_bytes", "17179869184\n");
        root.write("memory/docker/abc/memory.limit_in_bytes", "2147483648\n");
        root.write("memory/docker/abc/memory.usage_in_bytes", "1610612736\n");
        // A v2 file must not be read for the v1 hierarchy.
        root.write("memory/docker/abc/memory.current", "0\n");
        let proc = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n";
        assert_eq!(cgroup_headroom(root.path(), proc), Some(512 * MB));
        assert_eq!(free_memory_in(MEMINFO, root.path(), proc), Some(512 * MB));
    }

    #[test]
    fn free_memory_hybrid_the_smallest_headroom_wins() {
        let root = TempDir::new("free-hybrid");
        root.write("memory/svc/memory.limit_in_bytes", "3221225472\n");
        root.write("memory/svc/memory.usage_in_bytes", "1073741824\n");
        root.write("svc/memory.max", "2147483648\n");
        root.write("svc/memory.current", "1610612736\n");
        let proc = "7:memory:/svc\n0::/svc\n";
        assert_eq!(cgroup_headroom(root.path(), proc), Some(512 * MB));
    }

    #[test]
    fn this_process_has_some_free_memory() {
        // Linux always has /proc/meminfo, and a running machine has some memory free.
        let free = free_memory().expect("MemFree");
        assert!(free > 0 && free < UNLIMITED_FROM, "{free}");
    }

    #[test]
    fn this_process_gets_an_answer() {
        // Whatever this machine is: never more than the RAM given, never 0 with RAM known.
        let usable = usable_memory(16 * GB);
        assert!(usable > 0 && usable <= 16 * GB, "{usable}");
    }
}
