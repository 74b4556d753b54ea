//! The service manager's file-descriptor store, in systemd's protocol: `FDSTORE=1` with
//! `FDNAME=` and the descriptor in `SCM_RIGHTS` to keep one, `FDSTOREREMOVE=1` to drop it
//! (sd_notify(3)), and the kept ones passed to the next start as `LISTEN_FDS` and
//! `LISTEN_FDNAMES` from descriptor 3 on (sd_listen_fds(3)). Under systemd, systemd keeps
//! them; anywhere else `strata supervise` does, speaking the same protocol.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::sync::Mutex;

#[derive(Debug, thiserror::Error)]
pub enum FdStoreError {
    #[error("NOTIFY_SOCKET {0:?} is neither a path nor an abstract name")]
    BadSocket(OsString),
    #[error("cannot tell the service manager {what}: {source}")]
    Send { what: String, source: std::io::Error },
    #[error("descriptor name {0:?} has a ':' or is longer than 255 bytes")]
    BadName(String),
}

/// The store this process was started under, with what it handed back at start.
#[derive(Debug)]
pub struct FdStore {
    socket: OsString,
    /// Descriptors passed at start and not yet taken, by name.
    kept: Mutex<HashMap<String, Vec<OwnedFd>>>,
}

impl FdStore {
    /// The store named by `NOTIFY_SOCKET`, holding what `LISTEN_FDS` passed. `None` without
    /// one: then nothing outlives this process. Call once, at start, before other threads
    /// open files: the passed descriptors are claimed here.
    pub fn from_env() -> Option<FdStore> {
        let socket = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty())?;
        let for_us = std::env::var("LISTEN_PID").map_or(true, |p| p.parse() == Ok(std::process::id()));
        let count = std::env::var("LISTEN_FDS").ok().and_then(|n| n.parse::<usize>().ok()).filter(|_| for_us);
        let names: Vec<String> =
            std::env::var("LISTEN_FDNAMES").map(|n| n.split(':').map(str::to_owned).collect()).unwrap_or_default();
        let mut kept: HashMap<String, Vec<OwnedFd>> = HashMap::new();
        for (i, fd) in super::fds::inherited(count.unwrap_or(0)).into_iter().enumerate() {
            let name = names.get(i).cloned().unwrap_or_else(|| "unknown".into());
            kept.entry(name).or_default().push(fd);
        }
        Some(FdStore { socket, kept: Mutex::new(kept) })
    }

    /// Takes the descriptor kept under `name`, if the last run kept one.
    pub fn take(&self, name: &str) -> Option<OwnedFd> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let fds = kept.get_mut(name)?;
        let fd = fds.pop();
        if fds.is_empty() {
            kept.remove(name);
        }
        fd
    }

    /// Names of descriptors passed at start that nothing took.
    pub fn untaken(&self) -> Vec<String> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    /// Has the manager keep `fd` under `name` until it is removed.
    pub fn keep(&self, name: &str, fd: BorrowedFd<'_>) -> Result<(), FdStoreError> {
        check_name(name)?;
        self.send(&format!("FDSTORE=1\nFDNAME={name}\n"), Some(fd))
    }

    /// Has the manager close what it keeps under `name`.
    pub fn remove(&self, name: &str) -> Result<(), FdStoreError> {
        check_name(name)?;
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}\n"), None)
    }

    /// Sends a state line (`READY=1`, `STOPPING=1`, `STATUS=...`).
    pub fn notify(&self, state: &str) -> Result<(), FdStoreError> {
        self.send(&format!("{state}\n"), None)
    }

    fn send(&self, message: &str, fd: Option<BorrowedFd<'_>>) -> Result<(), FdStoreError> {
        use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
        let what = message.lines().next().unwrap_or_default().to_owned();
        let fail = |source| FdStoreError::Send { what: what.clone(), source };
        let bytes = self.socket.as_bytes();
        let addr = match bytes.first() {
            Some(b'/') => UnixAddr::new(bytes),
            Some(b'@') => UnixAddr::new_abstract(&bytes[1..]),
            _ => return Err(FdStoreError::BadSocket(self.socket.clone())),
        }
        .map_err(|e| fail(e.into()))?;
        let sock = UnixDatagram::unbound().map_err(fail)?;
        let raw = fd.map(|f| [f.as_raw_fd()]);
        let cmsgs: Vec<ControlMessage> = raw.as_ref().map(|r| ControlMessage::ScmRights(r)).into_iter().collect();
        sendmsg(sock.as_raw_fd(), &[IoSlice::new(message.as_bytes())], &cmsgs, MsgFlags::empty(), Some(&addr))
            .map_err(|e| fail(e.into()))?;
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), FdStoreError> {
    if name.contains(':') || name.len() > 255 || name.is_empty() {
        return Err(FdStoreError::BadName(name.to_owned()));
    }
    Ok(())
}
