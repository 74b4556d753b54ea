//! Mounting: the fuser session with the options pods need, and the tuning the kernel does not
//! do by itself.

use crate::core::FsCore;
use crate::fuse::{KernelTtl, StrataFs};
use fuser::{BackgroundSession, Config, MountOption, SessionACL};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("mount point {path}: {message}")]
    MountPoint { path: String, message: String },
    #[error("mounting {path} failed: {source} (is /dev/fuse there, and fuse3's fusermount3 installed?)")]
    Fuse { path: String, source: std::io::Error },
    #[error("cannot mount {path}: {message}")]
    Source { path: String, message: String },
}

#[derive(Debug, Clone)]
pub struct MountOptions {
    pub ttl: KernelTtl,
    /// FUSE worker threads, each with its own cloned /dev/fuse descriptor.
    pub threads: usize,
    /// Let other users (pods) in; the kernel then checks permissions itself.
    pub allow_other: bool,
    /// Kernel read-ahead for the mount, in KiB.
    pub read_ahead_kb: u32,
    /// Honour device nodes and setuid bits, as an image layer under an overlay must; a
    /// dataset mount turns both off.
    pub dev_suid: bool,
    /// The tree and its files never change for the life of the mount (an image layer): the
    /// kernel then sends no opens or flushes, and caches directory listings.
    pub immutable: bool,
}

/// Mounts `core` at `mountpoint`; the mount lives as long as the returned session. A crashed
/// process leaves no stale mount: fusermount3 unmounts it (`AutoUnmount`).
pub fn mount(
    core: Arc<FsCore>,
    mountpoint: &Path,
    rt: tokio::runtime::Handle,
    opts: &MountOptions,
) -> Result<BackgroundSession, MountError> {
    let path = mountpoint.display().to_string();
    // A mount left by a process that died, and that nothing detached.
    if detach_if_dead(mountpoint) == Probe::Detached {
        warn!(mountpoint = %path, "detaching a dead mount left here before mounting again");
    }
    let meta = std::fs::metadata(mountpoint)
        .map_err(|e| MountError::MountPoint { path: path.clone(), message: e.to_string() })?;
    if !meta.is_dir() {
        return Err(MountError::MountPoint { path, message: "not a directory".into() });
    }
    let mut config = Config::default();
    config.mount_options = vec![
        // fusermount3 splits options on commas, so none may appear in the name.
        MountOption::FSName(format!("strata:{}", core.describe()).replace(',', ";")),
        MountOption::Subtype("strata".into()),
        MountOption::AutoUnmount,
    ];
    if !opts.dev_suid {
        config.mount_options.extend([MountOption::NoDev, MountOption::NoSuid]);
    }
    if opts.allow_other {
        config.mount_options.push(MountOption::DefaultPermissions);
        config.acl = SessionACL::All;
    } else {
        config.acl = SessionACL::RootAndOwner;
    }
    let writable = core.writable();
    if !writable {
        config.mount_options.push(MountOption::RO);
    }
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = opts.threads > 1;
    let fs = StrataFs::new(core, rt, opts.ttl, current_uid(), current_gid());
    let fs = if opts.immutable && !writable { fs.without_opens() } else { fs };
    let session = fuser::spawn_mount(fs, mountpoint, &config)
        .map_err(|source| MountError::Fuse { path: path.clone(), source })?;
    crate::guard::watch(mountpoint);
    raise_read_ahead(mountpoint, opts.read_ahead_kb);
    info!(mountpoint = %path, threads = opts.threads, "mounted");
    Ok(session)
}

/// Unmounts and waits for the session's threads. The mount is detached explicitly (as
/// `fusermount3 -u -z` would), because the auto-unmount helper only acts when the process dies.
/// Files still open on a detached mount keep its connection alive; rather than wait for them
/// forever, this gives up after `wait` and lets process exit end the connection (their next
/// access fails with ENOTCONN).
pub fn unmount(session: BackgroundSession, mountpoint: &Path, wait: std::time::Duration) -> Result<(), MountError> {
    let path = mountpoint.display().to_string();
    let detached = std::process::Command::new("fusermount3")
        .args(["-u", "-z"])
        .arg(mountpoint)
        .status()
        .map_err(|source| MountError::Fuse { path: path.clone(), source })?;
    if !detached.success() {
        warn!(mountpoint = %path, "fusermount3 -u failed; the mount may already be gone");
    }
    crate::guard::forget(mountpoint);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(session.umount_and_join());
    });
    match rx.recv_timeout(wait) {
        Ok(r) => r.map_err(|source| MountError::Fuse { path, source }),
        Err(_) => {
            warn!(mountpoint = %path, "files are still open on the detached mount; not waiting for them");
            Ok(())
        }
    }
}

/// What [`detach_if_dead`] found at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// A dead FUSE mount, now detached.
    Detached,
    /// Its connection is being torn down as we ask: ask again shortly for the final answer.
    TearingDown,
    /// A live mount, a plain directory, or something else that is not ours to detach.
    LeftAlone,
}

/// Detaches `path` (lazily, as `fusermount3 -u -z` does) if it is a FUSE mount whose
/// connection is gone. Only an open asks the connection: a stat may be answered from
/// attributes the kernel still caches.
pub(crate) fn detach_if_dead(path: &Path) -> Probe {
    use nix::errno::Errno;
    use nix::mount::MntFlags;
    match std::fs::File::open(path).map_err(|e| e.raw_os_error()) {
        Err(Some(e)) if e == Errno::ENOTCONN as i32 => {
            match nix::mount::umount2(path, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
                Ok(()) => Probe::Detached,
                Err(_) => Probe::LeftAlone,
            }
        }
        Err(Some(e)) if e == Errno::ECONNABORTED as i32 => Probe::TearingDown,
        _ => Probe::LeftAlone,
    }
}

/// The kernel reads ahead only 128 KiB on a FUSE mount unless the mount's BDI says otherwise.
fn raise_read_ahead(mountpoint: &Path, kb: u32) {
    let Ok(meta) = std::fs::metadata(mountpoint) else { return };
    let dev = meta.dev();
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = std::fs::write(&knob, kb.to_string()) {
        warn!(knob, error = %e, "could not raise the mount's read-ahead; reads stay at 128 KiB");
    }
}

fn current_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}

fn current_gid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| m.gid()).unwrap_or(0)
}
