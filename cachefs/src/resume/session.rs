//! Serving a FUSE connection an earlier process set up. fuser starts every session with the
//! INIT handshake, and the kernel sends INIT once per connection, to the process that mounted.
//! So the session is built on one end of a socket pair, from which it reads that INIT replayed
//! (with the kernel's capabilities as the first run recorded them), and the connection's
//! descriptor is then put under the session's descriptor number before its reader threads
//! start. Last, the kernel is asked to send again every request the old process read and did
//! not answer (`FUSE_NOTIFY_RESEND`, Linux 6.9): those readers would otherwise wait forever.

use fuser::{Config, Filesystem, Session};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use serde::{Deserialize, Serialize};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

const FUSE_INIT: u32 = 26;
const FUSE_INIT_EXT: u64 = 1 << 30;
const FUSE_NOTIFY_RESEND: i32 = 7;
const IN_HEADER: usize = 40;
const INIT_IN: usize = 64;

/// What the kernel offered at a connection's INIT: enough to replay it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitRecord {
    pub major: u32,
    pub minor: u32,
    pub capabilities: u64,
}

impl InitRecord {
    pub fn of(config: &fuser::KernelConfig) -> InitRecord {
        let v = config.kernel_abi();
        InitRecord { major: v.0, minor: v.1, capabilities: config.capabilities().bits() }
    }

    /// The INIT request as the kernel sent it, but for its sender's ids.
    fn message(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(IN_HEADER + INIT_IN);
        m.extend_from_slice(&((IN_HEADER + INIT_IN) as u32).to_le_bytes());
        m.extend_from_slice(&FUSE_INIT.to_le_bytes());
        m.extend_from_slice(&1u64.to_le_bytes()); // unique
        m.extend_from_slice(&0u64.to_le_bytes()); // nodeid
        m.extend_from_slice(&[0u8; 16]); // uid, gid, pid, extension length and padding
        let flags = self.capabilities | FUSE_INIT_EXT;
        for v in [self.major, self.minor, 1 << 20, flags as u32, (flags >> 32) as u32] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        m.resize(IN_HEADER + INIT_IN, 0);
        m
    }
}

/// A session of `fs` on the live connection `conn`, which an earlier process mounted and
/// initialized as `init` records.
pub fn resume<FS: Filesystem>(fs: FS, conn: OwnedFd, config: &Config, init: &InitRecord) -> io::Result<Session<FS>> {
    let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
    nix::unistd::write(&ours, &init.message())?;
    let session = Session::from_fd(fs, theirs, config.acl, config.clone())?;
    // fuse_out_header: length, then the error of the answer.
    let mut reply = [0u8; 256];
    let n = nix::unistd::read(&ours, &mut reply)?;
    let error = (n >= 8).then(|| i32::from_le_bytes([reply[4], reply[5], reply[6], reply[7]]));
    if error != Some(0) {
        return Err(io::Error::other(format!("the filesystem refused the replayed INIT (error {error:?})")));
    }
    super::fds::replace(session.as_fd(), conn.as_fd())?;
    Ok(session)
}

/// Asks the kernel to queue again the requests of this connection that were read and not
/// answered. Kernels before 6.9 refuse it; their requests stay with the process that read them.
pub fn resend(conn: BorrowedFd<'_>) -> io::Result<()> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&FUSE_NOTIFY_RESEND.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    nix::unistd::write(conn, &h)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replayed_init_carries_the_recorded_version_and_both_flag_words() {
        let r = InitRecord { major: 7, minor: 41, capabilities: (1 << 35) | 1 };
        let m = r.message();
        assert_eq!(m.len(), 104);
        assert_eq!(u32::from_le_bytes(m[0..4].try_into().unwrap()), 104);
        assert_eq!(u32::from_le_bytes(m[4..8].try_into().unwrap()), FUSE_INIT);
        assert_eq!(u32::from_le_bytes(m[40..44].try_into().unwrap()), 7);
        assert_eq!(u32::from_le_bytes(m[44..48].try_into().unwrap()), 41);
        assert_eq!(u32::from_le_bytes(m[52..56].try_into().unwrap()), 1 | (1 << 30));
        assert_eq!(u32::from_le_bytes(m[56..60].try_into().unwrap()), 1 << 3);
    }
}
