//! Mounting: the fuser session with the options pods need, and the tuning the kernel does not
//! do by itself.

use crate::core::FsCore;
use crate::fuse::{KernelTtl, StrataFs};
use fuser::{BackgroundSession, Config, MountOption, SessionACL};
use std::os::fd::AsFd;
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
/// process leaves no stale mount: fusermount3 unmounts it (`AutoUnmount`). Under a descriptor
/// store (see [`crate::resume`]) the connection is kept instead, and a mount an earlier run
/// left at `mountpoint` is taken over, open files and all.
pub fn mount(
    core: Arc<FsCore>,
    mountpoint: &Path,
    rt: tokio::runtime::Handle,
    opts: &MountOptions,
) -> Result<BackgroundSession, MountError> {
    let path = mountpoint.display().to_string();
    let resume = crate::resume::get();
    if let Some(r) = resume
        && let Some(adopted) = r.adopt(mountpoint)
    {
        let started = std::time::Instant::now();
        match take_over(core.clone(), mountpoint, rt.clone(), opts, adopted) {
            Ok(session) => {
                info!(mountpoint = %path, took = ?started.elapsed(), "took over the mount an earlier run left");
                return Ok(session);
            }
            Err(e) => {
                // The kept connection is unusable: its mount goes, and a new one replaces it.
                warn!(mountpoint = %path, error = %e, "cannot take over the kept mount; mounting anew");
                r.release(mountpoint);
                let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
    // A mount left by a process that died, and that nothing detached.
    if detach_if_dead(mountpoint) == Probe::Detached {
        warn!(mountpoint = %path, "detaching a dead mount left here before mounting again");
    }
    let meta = std::fs::metadata(mountpoint)
        .map_err(|e| MountError::MountPoint { path: path.clone(), message: e.to_string() })?;
    if !meta.is_dir() {
        return Err(MountError::MountPoint { path, message: "not a directory".into() });
    }
    let config = session_config(&core, opts, resume.is_some());
    let fs = filesystem(core.clone(), rt, opts);
    let init_seen = fs.init_seen();
    let fuse_err = |source| MountError::Fuse { path: path.clone(), source };
    let session = match resume {
        None => {
            let session = fuser::Session::new(fs, mountpoint, &config).map_err(fuse_err)?;
            crate::guard::watch(mountpoint);
            session
        }
        Some(r) => {
            let how = crate::resume::KeptMount {
                fsname: &fsname(&core),
                allow_other: opts.allow_other,
                dev_suid: opts.dev_suid,
                read_only: !core.writable(),
            };
            let conn = crate::resume::mount_kept(mountpoint, &how).map_err(fuse_err)?;
            let kept = conn.try_clone().map_err(fuse_err)?;
            let session = match fuser::Session::from_fd(fs, conn, config.acl, config.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
                    return Err(fuse_err(e));
                }
            };
            let journal = init_seen
                .get()
                .ok_or_else(|| "the session started without an INIT".to_string())
                .and_then(|init| r.keep(mountpoint, kept.as_fd(), *init));
            match journal {
                Ok(journal) => core.journal_to(journal),
                Err(e) => {
                    warn!(mountpoint = %path, error = %e, "cannot keep the mount's connection; a restart will end it")
                }
            }
            session
        }
    };
    let session = session.spawn().map_err(|source| MountError::Fuse { path: path.clone(), source })?;
    raise_read_ahead(mountpoint, opts.read_ahead_kb);
    info!(mountpoint = %path, threads = opts.threads, "mounted");
    Ok(session)
}

/// Serves the connection an earlier run kept for `mountpoint`, with its inodes and open
/// handles from the journal.
fn take_over(
    core: Arc<FsCore>,
    mountpoint: &Path,
    rt: tokio::runtime::Handle,
    opts: &MountOptions,
    adopted: crate::resume::Adopted,
) -> std::io::Result<BackgroundSession> {
    let state = crate::resume::Journal::read(&adopted.journal)?;
    core.restore(&state);
    core.journal_to(crate::resume::Journal::rewrite(&adopted.journal, &state)?);
    let config = session_config(&core, opts, true);
    let fs = filesystem(core, rt, opts);
    fs.inherit(state.handles.iter().map(|(fh, h)| (*fh, h.ino)));
    let session = crate::resume::session::resume(fs, adopted.conn, &config, &adopted.init)?;
    if let Err(e) = crate::resume::session::resend(session.as_fd()) {
        warn!(mountpoint = %mountpoint.display(), error = %e, "the kernel cannot resend what the last run read and did not answer; those requests wait until their caller gives up");
    }
    session.spawn()
}

fn session_config(core: &FsCore, opts: &MountOptions, kept: bool) -> Config {
    let mut config = Config::default();
    config.mount_options = vec![MountOption::FSName(fsname(core)), MountOption::Subtype("strata".into())];
    // A kept connection must outlive the process: nothing may unmount it when this one dies.
    if !kept {
        config.mount_options.push(MountOption::AutoUnmount);
    }
    if !opts.dev_suid {
        config.mount_options.extend([MountOption::NoDev, MountOption::NoSuid]);
    }
    if opts.allow_other {
        config.mount_options.push(MountOption::DefaultPermissions);
        config.acl = SessionACL::All;
    } else {
        config.acl = SessionACL::RootAndOwner;
    }
    if !core.writable() {
        config.mount_options.push(MountOption::RO);
    }
    config.n_threads = Some(opts.threads.max(1));
    // Requests a cloned descriptor read are failed when the process holding it dies, while
    // those read on the kept one wait to be sent again: a kept mount's threads share it.
    config.clone_fd = opts.threads > 1 && !kept;
    config
}

/// The mount's source, as `mount` and `df` show it. fusermount3 splits options on commas, so
/// none may appear in it.
fn fsname(core: &FsCore) -> String {
    format!("strata:{}", core.describe()).replace(',', ";")
}

fn filesystem(core: Arc<FsCore>, rt: tokio::runtime::Handle, opts: &MountOptions) -> StrataFs {
    let writable = core.writable();
    let fs = StrataFs::new(core, rt, opts.ttl, current_uid(), current_gid());
    if opts.immutable && !writable { fs.without_opens() } else { fs }
}

/// Unmounts and waits for the session's threads. The mount is detached explicitly (as
/// `fusermount3 -u -z` would), because the auto-unmount helper only acts when the process dies.
/// Files still open on a detached mount keep its connection alive; rather than wait for them
/// forever, this gives up after `wait` and lets process exit end the connection (their next
/// access fails with ENOTCONN).
pub fn unmount(session: BackgroundSession, mountpoint: &Path, wait: std::time::Duration) -> Result<(), MountError> {
    let path = mountpoint.display().to_string();
    if let Some(r) = crate::resume::get() {
        r.release(mountpoint);
    }
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
