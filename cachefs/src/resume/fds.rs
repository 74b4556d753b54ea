//! The few descriptor operations the standard library and nix offer only as `unsafe`: taking
//! ownership of descriptors another process handed us, and putting one open file under the
//! number another already holds. Each keeps its justification beside it.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The first descriptor a service manager passes (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// Takes ownership of the `count` descriptors a service manager passed from number 3 on.
/// Call it once, at start, before anything else could open or close those numbers.
pub fn inherited(count: usize) -> Vec<OwnedFd> {
    (0..count as RawFd)
        .map(|i| LISTEN_FDS_START + i)
        // Only numbers that are open: a manager that counted wrong must not make us own
        // (and later close) a number something else reuses.
        .filter(|&fd| nix::fcntl::fcntl(borrow(fd), nix::fcntl::FcntlArg::F_GETFD).is_ok())
        .map(|fd| {
            // SAFETY: the manager opened `fd` for us and nothing in this process has
            // claimed it yet (this runs once, at start); from here it has one owner.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let _ = nix::fcntl::fcntl(&owned, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
            owned
        })
        .collect()
}

/// Takes ownership of descriptors that arrived in an `SCM_RIGHTS` message.
pub fn received(fds: Vec<RawFd>) -> Vec<OwnedFd> {
    fds.into_iter()
        .map(|fd| {
            // SAFETY: the kernel installed `fd` in this process for this message alone, and
            // the caller got it from `recvmsg` just now: nothing else owns it.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let _ = nix::fcntl::fcntl(&owned, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
            owned
        })
        .collect()
}

/// Makes the number `target` refer to the open file `source` refers to, atomically: whoever
/// holds `target` (a session's reader threads) reads from `source`'s file from its next call.
pub fn replace(target: BorrowedFd<'_>, source: BorrowedFd<'_>) -> std::io::Result<()> {
    // SAFETY: dup2 onto a number that stays owned by its holder: the number's owner is
    // unchanged, only the file under it is swapped (the old one is closed by the kernel).
    let r = unsafe { nix::libc::dup3(source.as_raw_fd(), target.as_raw_fd(), nix::libc::O_CLOEXEC) };
    if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

fn borrow(fd: RawFd) -> BorrowedFd<'static> {
    // SAFETY: only used for an fcntl(F_GETFD) probe, which is harmless on any number.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// A copy of `fd` numbered `min` or above, closed on exec.
pub fn dup_at_least(fd: BorrowedFd<'_>, min: RawFd) -> std::io::Result<OwnedFd> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(min))?;
    // SAFETY: F_DUPFD_CLOEXEC just made `raw` for us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Has `cmd`'s process start with `fds` as descriptors 3, 4, ... (the service manager's
/// layout), open across its exec. The copies are made above every target number first, so
/// that placing one never closes another still to be placed.
pub fn pass_from_three(cmd: &mut std::process::Command, fds: &[OwnedFd]) -> std::io::Result<Vec<OwnedFd>> {
    use std::os::unix::process::CommandExt;
    let top = LISTEN_FDS_START + fds.len() as RawFd;
    let high: Vec<OwnedFd> =
        fds.iter().map(|f| dup_at_least(std::os::fd::AsFd::as_fd(f), top)).collect::<std::io::Result<_>>()?;
    let raw: Vec<RawFd> = high.iter().map(AsRawFd::as_raw_fd).collect();
    // SAFETY: the hook runs in the child between fork and exec, and calls only dup2, which is
    // async-signal-safe; it allocates nothing (`raw` was built before the fork).
    unsafe {
        cmd.pre_exec(move || {
            for (i, fd) in raw.iter().enumerate() {
                if nix::libc::dup2(*fd, LISTEN_FDS_START + i as RawFd) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    // Kept open by the caller until the child has started.
    Ok(high)
}
