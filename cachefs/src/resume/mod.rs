//! Mounts that outlive the daemon. Each FUSE connection's descriptor is kept by the service
//! manager's file-descriptor store (systemd, or `strata supervise`), beside a state file and a
//! journal in the state dir. While a descriptor is kept, the kernel keeps the connection: a
//! reader whose daemon died waits instead of failing. A restarted daemon mounting the same
//! path takes the kept connection over instead of mounting anew.

pub mod fds;
mod fdstore;
mod journal;
pub mod session;

pub use fdstore::{FdStore, FdStoreError};
pub use journal::{HandleRecord, Journal, Record, Restored};
pub use session::InitRecord;

use crate::mountinfo;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tracing::{info, warn};

static STORE: OnceLock<Option<FdStore>> = OnceLock::new();
static RESUME: OnceLock<Resume> = OnceLock::new();

/// Claims what the service manager passed. Call first thing in `main`, before any thread or
/// file exists; returns whether this process runs under a descriptor store.
pub fn claim() -> bool {
    STORE.get_or_init(FdStore::from_env).is_some()
}

/// Turns on kept mounts, with their state files under `state_dir`. Without a store (see
/// [`claim`]) this does nothing and mounts end with the process, as before.
pub fn enable(state_dir: &Path) -> Result<(), std::io::Error> {
    let Some(Some(store)) = STORE.get() else { return Ok(()) };
    let dir = state_dir.join("fuse");
    std::fs::create_dir_all(&dir)?;
    let _ = RESUME.set(Resume { store, dir });
    Ok(())
}

/// The kept-mount bookkeeping, when [`enable`] turned it on.
pub fn get() -> Option<&'static Resume> {
    RESUME.get()
}

/// What one kept mount's state file says.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MountState {
    mountpoint: PathBuf,
    /// The connection's device ("major:minor" in mountinfo).
    dev: String,
    init: InitRecord,
}

/// A live connection left by an earlier run, to take over.
#[derive(Debug)]
pub struct Adopted {
    pub conn: OwnedFd,
    pub init: InitRecord,
    pub journal: PathBuf,
}

#[derive(Debug)]
pub struct Resume {
    store: &'static FdStore,
    dir: PathBuf,
}

impl Resume {
    fn name(mountpoint: &Path) -> String {
        let abs = std::path::absolute(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
        let h = Sha256::digest(abs.as_os_str().as_encoded_bytes());
        format!("fuse-{}", hex::encode(&h[..12]))
    }

    fn state_file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    fn journal_file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.journal"))
    }

    /// The connection an earlier run kept for `mountpoint`, if it is still the one mounted
    /// there. A kept descriptor whose mount is gone is dropped.
    pub fn adopt(&self, mountpoint: &Path) -> Option<Adopted> {
        let name = Self::name(mountpoint);
        let conn = self.store.take(&name)?;
        let state: Option<MountState> =
            std::fs::read(self.state_file(&name)).ok().and_then(|b| serde_json::from_slice(&b).ok());
        // mountinfo, not stat: a stat of the mount would be a request nobody answers yet.
        let live = mountinfo::device_at(mountpoint);
        match state {
            Some(s) if live.as_deref() == Some(s.dev.as_str()) => {
                Some(Adopted { conn, init: s.init, journal: self.journal_file(&name) })
            }
            s => {
                warn!(
                    mountpoint = %mountpoint.display(),
                    recorded = ?s.map(|s| s.dev),
                    mounted = ?live,
                    "a kept FUSE connection no longer matches what is mounted there; mounting anew"
                );
                drop(conn);
                self.release(mountpoint);
                None
            }
        }
    }

    /// Keeps a new connection for `mountpoint`; returns the journal to write its state to.
    pub fn keep(&self, mountpoint: &Path, conn: BorrowedFd<'_>, init: InitRecord) -> Result<Journal, String> {
        let name = Self::name(mountpoint);
        let dev = mountinfo::device_at(mountpoint).ok_or("the new mount is not in mountinfo")?;
        let state = MountState { mountpoint: mountpoint.to_path_buf(), dev, init };
        let journal = Journal::create(&self.journal_file(&name)).map_err(|e| e.to_string())?;
        let bytes = serde_json::to_vec(&state).map_err(|e| e.to_string())?;
        let file = self.state_file(&name);
        let tmp = file.with_extension("json.tmp");
        std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &file)).map_err(|e| e.to_string())?;
        self.store.keep(&name, conn).map_err(|e| e.to_string())?;
        Ok(journal)
    }

    /// Forgets `mountpoint`'s connection: the store closes its copy, and the state goes.
    pub fn release(&self, mountpoint: &Path) {
        let name = Self::name(mountpoint);
        if let Err(e) = self.store.remove(&name) {
            warn!(mountpoint = %mountpoint.display(), error = %e, "cannot drop a kept FUSE connection");
        }
        let _ = std::fs::remove_file(self.state_file(&name));
        let _ = std::fs::remove_file(self.journal_file(&name));
    }

    /// Lets go of the connections passed at start that no mount took over (their mounts are
    /// no longer configured): each is unmounted, as a clean stop would have, and the store
    /// closes its copy.
    pub fn drop_untaken(&self) {
        for name in self.store.untaken() {
            let conn = self.store.take(&name);
            let state: Option<MountState> =
                std::fs::read(self.state_file(&name)).ok().and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(s) = state
                && mountinfo::device_at(&s.mountpoint).as_deref() == Some(s.dev.as_str())
            {
                info!(mountpoint = %s.mountpoint.display(), "unmounting a mount of before the restart that is no longer configured");
                let _ = nix::mount::umount2(&s.mountpoint, nix::mount::MntFlags::MNT_DETACH);
            }
            drop(conn);
            let _ = self.store.remove(&name);
            let _ = std::fs::remove_file(self.state_file(&name));
            let _ = std::fs::remove_file(self.journal_file(&name));
        }
    }

    /// Keeps `bytes` under `name` in the store itself (a sealed memfd), never on disk: what a
    /// successor needs that may hold secrets (a CSI volume's credentials).
    pub fn keep_note(&self, name: &str, bytes: &[u8]) -> Result<(), String> {
        use nix::fcntl::{FcntlArg, SealFlag};
        use nix::sys::memfd::{MFdFlags, memfd_create};
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).map_err(|e| e.to_string())?;
        let file = std::fs::File::from(fd);
        std::io::Write::write_all(&mut &file, bytes).map_err(|e| e.to_string())?;
        let seals = SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL;
        nix::fcntl::fcntl(&file, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| e.to_string())?;
        self.store.keep(name, std::os::fd::AsFd::as_fd(&file)).map_err(|e| e.to_string())
    }

    /// Takes the notes passed at start whose names start with `prefix`, with their bytes.
    pub fn take_notes(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        use std::os::unix::fs::FileExt;
        let mut out = Vec::new();
        for name in self.store.untaken().into_iter().filter(|n| n.starts_with(prefix)) {
            let Some(fd) = self.store.take(&name) else { continue };
            let file = std::fs::File::from(fd);
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            let mut bytes = vec![0u8; len as usize];
            match file.read_exact_at(&mut bytes, 0) {
                Ok(()) => out.push((name, bytes)),
                Err(e) => warn!(name, error = %e, "cannot read a kept note"),
            }
        }
        out
    }

    /// Has the store drop the note `name`.
    pub fn forget_note(&self, name: &str) {
        if let Err(e) = self.store.remove(name) {
            warn!(name, error = %e, "cannot drop a kept note");
        }
    }

    /// Tells the store's keeper a state (`READY=1`, `STOPPING=1`).
    pub fn notify(&self, state: &str) {
        if let Err(e) = self.store.notify(state) {
            warn!(error = %e, "cannot notify the service manager");
        }
    }
}

/// How a kept mount is made.
#[derive(Debug, Clone)]
pub struct KeptMount<'a> {
    /// The mount's source, as `mount` and `df` show it.
    pub fsname: &'a str,
    pub allow_other: bool,
    pub dev_suid: bool,
    pub read_only: bool,
}

/// Mounts a new FUSE connection at `mountpoint` with mount(2) itself, as `fuse.strata`, and
/// returns its descriptor. No helper is left watching (fusermount3's auto-unmount would end
/// the mount with this process, which is what a kept mount must survive).
pub fn mount_kept(mountpoint: &Path, how: &KeptMount<'_>) -> std::io::Result<OwnedFd> {
    use nix::mount::MsFlags;
    use std::os::fd::AsRawFd;
    let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse")?;
    let conn = OwnedFd::from(dev);
    let uid = nix::unistd::geteuid();
    let gid = nix::unistd::getegid();
    let mut data = format!("fd={},rootmode=40000,user_id={uid},group_id={gid}", conn.as_raw_fd());
    if how.allow_other {
        data.push_str(",default_permissions,allow_other");
    }
    let mut flags = MsFlags::empty();
    if !how.dev_suid {
        flags |= MsFlags::MS_NODEV | MsFlags::MS_NOSUID;
    }
    if how.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    nix::mount::mount(Some(how.fsname), mountpoint, Some("fuse.strata"), flags, Some(data.as_str()))?;
    Ok(conn)
}
