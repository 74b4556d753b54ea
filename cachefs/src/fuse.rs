//! The fuser adapter: each kernel request becomes a task on the runtime, which replies when the
//! core answers. Errors become errno here and only here, and are logged here, once.

use crate::core::{Attr, FsCore, FsError, ROOT};
use crate::namespace::NodeKind;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Handle;
use tracing::{Instrument, info_span, warn};

/// How long the kernel may trust what it is told.
#[derive(Debug, Clone, Copy)]
pub struct KernelTtl {
    pub entry: Duration,
    pub attr: Duration,
}

pub struct StrataFs {
    core: Arc<FsCore>,
    rt: Handle,
    ttl: KernelTtl,
    uid: u32,
    gid: u32,
}

impl std::fmt::Debug for StrataFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StrataFs").field("core", &self.core).finish()
    }
}

impl StrataFs {
    pub fn new(core: Arc<FsCore>, rt: Handle, ttl: KernelTtl, uid: u32, gid: u32) -> Self {
        StrataFs { core, rt, ttl, uid, gid }
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        file_attr(a, self.uid, self.gid)
    }
}

fn errno(op: &str, e: &FsError) -> Errno {
    match e {
        FsError::NotFound => Errno::ENOENT,
        FsError::NotDir => Errno::ENOTDIR,
        FsError::IsDir => Errno::EISDIR,
        FsError::BadHandle => Errno::EBADF,
        FsError::List { .. } | FsError::Read { .. } => {
            warn!(op, error = %e, "returning EIO");
            Errno::EIO
        }
    }
}

impl Filesystem for StrataFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // 1 MiB requests (the kernel's max_pages_limit here) instead of the 128 KiB default.
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str().map(str::to_string) else {
            return reply.error(Errno::ENOENT);
        };
        let core = self.core.clone();
        let ttl = self.ttl;
        let (uid, gid) = (self.uid, self.gid);
        self.rt.spawn(
            async move {
                match core.lookup(parent.0, &name).await {
                    Ok(a) => reply.entry(&ttl.entry, &file_attr(&a, uid, gid), Generation(0)),
                    Err(e) => reply.error(errno("lookup", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "lookup")),
        );
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.core.getattr(ino.0) {
            Ok(a) => reply.attr(&self.ttl.attr, &self.file_attr(&a)),
            Err(e) => reply.error(errno("getattr", &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc_accmode() != 0 {
            return reply.error(Errno::EROFS);
        }
        match self.core.open(ino.0) {
            // Dataset files do not change under an open handle, so the page cache may keep them.
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno("open", &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let core = self.core.clone();
        self.rt.spawn(
            async move {
                match core.read(fh.0, offset, size).await {
                    Ok(b) => reply.data(&b),
                    Err(e) => reply.error(errno("read", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "read", offset, size)),
        );
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.core.release(fh.0);
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.core.getattr(ino.0) {
            Ok(a) if a.kind == NodeKind::Dir => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let core = self.core.clone();
        self.rt.spawn(
            async move {
                match core.readdir(ino.0).await {
                    Ok(entries) => {
                        for (i, (child, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
                            let kind = if *kind == NodeKind::Dir { FileType::Directory } else { FileType::RegularFile };
                            let child = if name == ".." { ROOT.max(*child) } else { *child };
                            if reply.add(INodeNo(child), (i + 1) as u64, kind, name) {
                                break;
                            }
                        }
                        reply.ok();
                    }
                    Err(e) => reply.error(errno("readdir", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "readdir", offset)),
        );
    }
}

/// `O_WRONLY | O_RDWR`: this first version of the mount is read-only.
fn libc_accmode() -> i32 {
    0o1 | 0o2
}

fn file_attr(a: &Attr, uid: u32, gid: u32) -> FileAttr {
    let (kind, perm, nlink) = match a.kind {
        NodeKind::Dir => (FileType::Directory, 0o555, 2),
        NodeKind::File => (FileType::RegularFile, 0o444, 1),
    };
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind,
        perm,
        nlink,
        uid,
        gid,
        rdev: 0,
        flags: 0,
        blksize: 1 << 20,
    }
}
