//! The fuser adapter: a kernel request whose answer the core has at hand is answered on the
//! FUSE thread; any other becomes a task on the runtime, which replies when the core answers.
//! Errors become errno here and only here, and are logged here, once.

use crate::core::{Attr, FsCore, FsError, ROOT};
use crate::implicit::Implicit;
use crate::namespace::NodeKind;
use crate::openers::Openers;
use crate::passthrough::{IoModes, Mode, PageCache};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, WriteFlags,
};
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Handle;
use tracing::{Instrument, info_span, warn};

/// Files of a mount without opens whose read state is kept at once.
const IMPLICIT_HANDLES: usize = 256;

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
    /// The kernel agreed to passthrough at init.
    passthrough: bool,
    modes: Arc<IoModes>,
    /// Set for a tree that never changes: opens, flushes and directory opens take no message,
    /// and reads come without a handle (see `implicit`).
    implicit: Option<Arc<Implicit>>,
    /// The process that opened each handle that writes: only its flushes publish.
    openers: Arc<Openers>,
    /// Where what the kernel offered at INIT goes, for a successor to replay.
    init_seen: Arc<std::sync::OnceLock<crate::resume::InitRecord>>,
}

impl std::fmt::Debug for StrataFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StrataFs").field("core", &self.core).finish()
    }
}

impl StrataFs {
    pub fn new(core: Arc<FsCore>, rt: Handle, ttl: KernelTtl, uid: u32, gid: u32) -> Self {
        StrataFs {
            core,
            rt,
            ttl,
            uid,
            gid,
            passthrough: false,
            modes: Arc::new(IoModes::default()),
            implicit: None,
            openers: Arc::default(),
            init_seen: Arc::default(),
        }
    }

    /// Takes on the open handles `(fh, ino)` of an earlier process, after a takeover: new opens
    /// of their inodes use direct I/O until they are closed.
    pub fn inherit(&self, handles: impl IntoIterator<Item = (u64, u64)>) {
        self.modes.inherit(handles);
    }

    /// What the kernel offered at INIT, once the session has started.
    pub fn init_seen(&self) -> Arc<std::sync::OnceLock<crate::resume::InitRecord>> {
        self.init_seen.clone()
    }

    /// For a read-only tree that never changes under the mount: the kernel sends no opens and
    /// no flushes, and caches directory listings.
    pub fn without_opens(mut self) -> Self {
        self.implicit = Some(Arc::new(Implicit::new(IMPLICIT_HANDLES)));
        self
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        file_attr(a, self.uid, self.gid, self.core.writable())
    }
}

fn errno(op: &str, e: &FsError) -> Errno {
    match e {
        FsError::NotFound => Errno::ENOENT,
        FsError::NotDir => Errno::ENOTDIR,
        FsError::IsDir => Errno::EISDIR,
        FsError::BadHandle | FsError::NotWritable => Errno::EBADF,
        FsError::NotSupported(why) => {
            warn!(op, why, "refused with EPERM");
            Errno::EPERM
        }
        FsError::Exists => Errno::EEXIST,
        FsError::NotEmpty => Errno::ENOTEMPTY,
        FsError::Invalid(_) => Errno::EINVAL,
        // A full staging disk is the writer's to see as such ("No space left on device"), not
        // as an I/O error: it can free space or write elsewhere.
        FsError::Stage { source, .. }
            if source.raw_os_error().is_some_and(|c| c == nix::libc::ENOSPC || c == nix::libc::EDQUOT) =>
        {
            warn!(op, error = %e, "the staging disk is full");
            Errno::from_i32(source.raw_os_error().unwrap_or(nix::libc::ENOSPC))
        }
        FsError::List { .. }
        | FsError::Read { .. }
        | FsError::Stage { .. }
        | FsError::Publish { .. }
        | FsError::Namespace { .. } => {
            warn!(op, error = %e, "returning EIO");
            Errno::EIO
        }
    }
}

impl Filesystem for StrataFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = self.init_seen.set(crate::resume::InitRecord::of(config));
        // 1 MiB requests (the kernel's max_pages_limit here) instead of the 128 KiB default.
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        // O_TRUNC arrives with open, so a truncating open can start a rewrite at once.
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ATOMIC_O_TRUNC);
        let _ = config.set_max_write(1 << 20);
        if self.implicit.is_some() {
            // A tree that never changes: the kernel may keep symlink targets in its page cache
            // instead of asking for each one at every path walk through the link.
            let _ = config.add_capabilities(fuser::InitFlags::FUSE_CACHE_SYMLINKS);
        }
        if self.core.passthrough_wanted() {
            // Depth 1: backing files sit on a plain filesystem, and this mount may itself be an
            // overlayfs lower layer (image layers are).
            self.passthrough = config.add_capabilities(fuser::InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !self.passthrough {
                warn!("the kernel does not offer FUSE passthrough; every read goes through the daemon");
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str().map(str::to_string) else {
            return reply.error(Errno::ENOENT);
        };
        let core = self.core.clone();
        let ttl = self.ttl;
        let (uid, gid, w) = (self.uid, self.gid, self.core.writable());
        self.answer(
            async move {
                match core.lookup(parent.0, &name).await {
                    Ok(a) => reply.entry(&ttl.entry, &file_attr(&a, uid, gid, w), Generation(0)),
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

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.0 & O_ACCMODE_WRITE != 0;
        if write && !self.core.writable() {
            return reply.error(Errno::EROFS);
        }
        if self.implicit.is_some() {
            // Taken by the kernel as success, for this open and every later one.
            return reply.error(Errno::ENOSYS);
        }
        if flags.0 & O_APPEND != 0 && write {
            return reply
                .error(errno("open", &FsError::NotSupported("appending to an existing object is not possible")));
        }
        let truncate = write && flags.0 & O_TRUNC != 0;
        // Waits for a write or an upload of the file under way; this is a FUSE worker thread,
        // outside the runtime, so it may block.
        if truncate
            && self.core.staging(ino.0)
            && let Err(e) = self.rt.block_on(self.core.truncate_staged(ino.0))
        {
            return reply.error(errno("open", &e));
        }
        // An open that does not start the file again waits for a close's upload of it under
        // way, and then sees the object that upload made.
        if !truncate && self.core.closing(ino.0) {
            self.rt.block_on(self.core.settle_closing(ino.0));
        }
        let fh = match self.core.open(ino.0, write, truncate) {
            Ok(fh) => fh,
            Err(e) => return reply.error(errno("open", &e)),
        };
        if write {
            self.openers.opened(fh, req.pid());
        }
        let version = if write { None } else { self.core.read_only_version(fh) };
        let (mode, backing, pages) = self.modes.open(ino.0, fh, version.as_deref(), || {
            let file = self.passthrough.then(|| self.core.whole_file(fh)).flatten()?;
            reply
                .open_backing(&file)
                .inspect_err(|e| warn!(error = %e, "registering a backing file failed; reading through the daemon"))
                .ok()
        });
        self.core.count_open(mode.as_str());
        tracing::debug!(ino = ino.0, fh, mode = mode.as_str(), "opened");
        // A reader's close has nothing to flush, so the kernel need not wait on a FLUSH round
        // trip for it: with thousands of small files (an image layer) that is a third of the
        // requests a container's reads make.
        let noflush = if write { FopenFlags::empty() } else { FopenFlags::FOPEN_NOFLUSH };
        match (mode, backing) {
            (Mode::Passthrough, Some(id)) => reply.opened_passthrough(FileHandle(fh), noflush, &id),
            (Mode::Direct, _) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO | noflush),
            // Dataset files do not change under an open handle, so the page cache may keep them,
            // as long as they are of this open's version.
            _ if !write && pages == PageCache::Keep => {
                reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE | noflush)
            }
            _ if !write => reply.opened(FileHandle(fh), noflush),
            _ => reply.opened(FileHandle(fh), FopenFlags::empty()),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        if !self.core.writable() {
            return reply.error(Errno::EROFS);
        }
        let Some(name) = name.to_str().map(str::to_string) else { return reply.error(Errno::EINVAL) };
        let (core, ttl, uid, gid, w) = (self.core.clone(), self.ttl, self.uid, self.gid, self.core.writable());
        let (modes, openers, pid) = (self.modes.clone(), self.openers.clone(), req.pid());
        self.rt.spawn(
            async move {
                match core.create(parent.0, &name).await {
                    Ok((a, fh)) => {
                        openers.opened(fh, pid);
                        let flags = match modes.open(a.ino, fh, None, || None).0 {
                            Mode::Direct => FopenFlags::FOPEN_DIRECT_IO,
                            _ => FopenFlags::empty(),
                        };
                        reply.created(&ttl.entry, &file_attr(&a, uid, gid, w), Generation(0), FileHandle(fh), flags)
                    }
                    Err(e) => reply.error(errno("create", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "create")),
        );
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let core = self.core.clone();
        let data = data.to_vec();
        self.rt.spawn(
            async move {
                match core.write(fh.0, offset, &data).await {
                    Ok(n) => reply.written(n),
                    Err(e) => reply.error(errno("write", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "write", offset)),
        );
    }

    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        if self.implicit.is_some() {
            // Nothing is ever written here: the kernel stops sending flushes.
            return reply.error(Errno::ENOSYS);
        }
        if !self.openers.is_opener(fh.0, req.pid()) {
            tracing::debug!(
                fh = fh.0,
                pid = req.pid(),
                "a flush by another process than the writer's is not a publish"
            );
            self.core.count_foreign_flush();
            return reply.ok();
        }
        self.finish("flush", fh, reply);
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        if self.implicit.is_some() {
            // A file of a tree that never changes has nothing to sync (and no handle to name).
            return reply.ok();
        }
        self.finish("fsync", fh, reply);
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let (core, ttl, uid, gid, w) = (self.core.clone(), self.ttl, self.uid, self.gid, self.core.writable());
        // Modes, owners and times are not stored in S3; accepting them keeps `cp -p` and `touch`
        // working, and the attributes shown stay those of the object.
        self.rt.spawn(async move {
            let r = match size {
                Some(size) => core.set_size(ino.0, size).await,
                None => core.getattr(ino.0),
            };
            match r {
                Ok(a) => reply.attr(&ttl.attr, &file_attr(&a, uid, gid, w)),
                Err(e) => reply.error(errno("setattr", &e)),
            }
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let Some(name) = name.to_str().map(str::to_string) else { return reply.error(Errno::ENOENT) };
        let core = self.core.clone();
        self.rt.spawn(async move {
            match core.unlink(parent.0, &name).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("unlink", &e)),
            }
        });
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, _mode: u32, _umask: u32, reply: ReplyEntry) {
        let Some(name) = name.to_str().map(str::to_string) else { return reply.error(Errno::EINVAL) };
        let (core, ttl, uid, gid, w) = (self.core.clone(), self.ttl, self.uid, self.gid, self.core.writable());
        self.rt.spawn(async move {
            match core.mkdir(parent.0, &name).await {
                Ok(a) => reply.entry(&ttl.entry, &file_attr(&a, uid, gid, w), Generation(0)),
                Err(e) => reply.error(errno("mkdir", &e)),
            }
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let Some(name) = name.to_str().map(str::to_string) else { return reply.error(Errno::ENOENT) };
        let core = self.core.clone();
        self.rt.spawn(async move {
            match core.rmdir(parent.0, &name).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("rmdir", &e)),
            }
        });
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (Some(name), Some(newname)) = (name.to_str().map(str::to_string), newname.to_str().map(str::to_string))
        else {
            return reply.error(Errno::EINVAL);
        };
        let noreplace = flags == fuser::RenameFlags::RENAME_NOREPLACE;
        if !flags.is_empty() && !noreplace {
            // RENAME_EXCHANGE needs an atomicity S3 does not have.
            return reply.error(Errno::EINVAL);
        }
        let core = self.core.clone();
        self.rt.spawn(
            async move {
                // `mv` asks for this first. The kernel has checked its own view of the name;
                // this mount's may be newer.
                if noreplace && core.lookup(newparent.0, &newname).await.is_ok() {
                    return reply.error(Errno::EEXIST);
                }
                match core.rename(parent.0, &name, newparent.0, &newname).await {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno("rename", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "rename")),
        );
    }

    /// What `df` and `statvfs` show. A writable mount stages every write on local disk before
    /// it goes up, so the staging disk's room is what a writer can count on: a checkpoint
    /// larger than its free space fails with `ENOSPC`. Tools that check free space before they
    /// write (Hugging Face `datasets`, for one) then decide right, where a made-up or zero size
    /// would fail them or mislead them. A read-only mount has no room for writes.
    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // S3 sets no limit on the number of objects.
        const FILES: u64 = 1 << 32;
        match self.core.staging_dir().map(nix::sys::statvfs::statvfs) {
            Some(Ok(s)) => reply.statfs(
                s.blocks(),
                s.blocks_free(),
                s.blocks_available(),
                FILES,
                FILES,
                s.block_size() as u32,
                255,
                s.fragment_size() as u32,
            ),
            Some(Err(e)) => {
                warn!(error = %e, "statfs of the staging dir failed");
                reply.error(Errno::from_i32(e as i32))
            }
            None => reply.statfs(0, 0, 0, FILES, 0, 4096, 255, 4096),
        }
    }

    fn link(&self, _req: &Request, _ino: INodeNo, _newparent: INodeNo, _newname: &OsStr, reply: ReplyEntry) {
        reply.error(errno("link", &FsError::NotSupported("hard links do not exist on an object store")));
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let core = self.core.clone();
        let implicit = self.implicit.clone();
        self.answer(
            async move {
                let result = match &implicit {
                    None => core.read(fh.0, offset, size).await,
                    Some(handles) => handles.read(&core, ino.0, offset, size).await,
                };
                match result {
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
        let mode = self.modes.released(fh.0);
        self.openers.released(fh.0);
        if self.core.release_reader(fh.0, mode == Some(Mode::Passthrough)) {
            return reply.ok();
        }
        let core = self.core.clone();
        self.rt.spawn(async move {
            // The kernel ignores release errors; flush already reported any upload failure to
            // close(), so here it is only logged.
            if let Err(e) = core.release(fh.0).await {
                errno("release", &e);
            }
            reply.ok();
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let core = self.core.clone();
        self.answer(
            async move {
                match core.readlink(ino.0).await {
                    Ok(target) => reply.data(target.as_bytes()),
                    Err(e) => reply.error(errno("readlink", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "readlink")),
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let core = self.core.clone();
        let name = name.to_string_lossy().into_owned();
        self.answer(
            async move {
                match core.xattrs(ino.0).await {
                    Ok(x) => match x.get(&name) {
                        Some(v) => reply_sized(reply, v, size),
                        None => reply.error(Errno::NO_XATTR),
                    },
                    Err(e) => reply.error(errno("getxattr", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "getxattr")),
        );
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let core = self.core.clone();
        self.answer(
            async move {
                match core.xattrs(ino.0).await {
                    Ok(x) => {
                        let mut names = Vec::new();
                        for k in x.keys() {
                            names.extend_from_slice(k.as_bytes());
                            names.push(0);
                        }
                        reply_sized(reply, &names, size)
                    }
                    Err(e) => reply.error(errno("listxattr", &e)),
                }
            }
            .instrument(info_span!("fuse", op = "listxattr")),
        );
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.implicit.is_some() {
            // No more directory opens, and the kernel keeps listings: the tree never changes.
            return reply.error(Errno::ENOSYS);
        }
        match self.core.getattr(ino.0) {
            Ok(a) if a.kind == NodeKind::Dir => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let core = self.core.clone();
        self.answer(
            async move {
                match core.readdir(ino.0).await {
                    Ok(entries) => {
                        for (i, (child, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
                            let kind = file_type(*kind);
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

/// `O_WRONLY | O_RDWR`.
const O_ACCMODE_WRITE: i32 = 0o1 | 0o2;
const O_TRUNC: i32 = 0o1000;
const O_APPEND: i32 = 0o2000;

impl StrataFs {
    /// Runs the answer to a request on this thread when it needs nothing to wait for (a tree
    /// in memory, a chunk in the page cache), and on the runtime otherwise. Handing every
    /// request to the runtime costs a thread wake-up, which a container start pays hundreds of
    /// times over: overlayfs asks a lower layer for each name, its xattrs and its links.
    fn answer(&self, answer: impl std::future::Future<Output = ()> + Send + 'static) {
        let _runtime = self.rt.enter();
        let mut answer = Box::pin(answer);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if answer.as_mut().poll(&mut cx).is_pending() {
            // The runtime polls it again, with a waker that counts.
            self.rt.spawn(answer);
        }
    }

    /// flush and fsync: publish what was written, and report any failure to the caller.
    fn finish(&self, op: &'static str, fh: FileHandle, reply: ReplyEmpty) {
        let core = self.core.clone();
        self.rt.spawn(
            async move {
                match core.flush(fh.0).await {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno(op, &e)),
                }
            }
            .instrument(info_span!("fuse", op)),
        );
    }
}

/// An xattr reply: the size when asked for it (`size` 0), the bytes if they fit, else ERANGE.
fn reply_sized(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() <= size as usize {
        reply.data(value);
    } else {
        reply.error(Errno::ERANGE);
    }
}

fn file_type(k: NodeKind) -> FileType {
    match k {
        NodeKind::File => FileType::RegularFile,
        NodeKind::Dir => FileType::Directory,
        NodeKind::Symlink => FileType::Symlink,
        NodeKind::CharDev => FileType::CharDevice,
        NodeKind::BlockDev => FileType::BlockDevice,
        NodeKind::Fifo => FileType::NamedPipe,
    }
}

fn file_attr(a: &Attr, uid: u32, gid: u32, writable: bool) -> FileAttr {
    let (mut perm, mut nlink, mut uid, mut gid, mut rdev) = match (a.kind, writable) {
        (NodeKind::Dir, true) => (0o755, 2, uid, gid, 0),
        (NodeKind::Dir, false) => (0o555, 2, uid, gid, 0),
        (_, true) => (0o644, 1, uid, gid, 0),
        (_, false) => (0o444, 1, uid, gid, 0),
    };
    // A namespace that knows ownership and modes (an image layer) shows them as they are.
    if let Some(p) = a.posix {
        (perm, nlink, uid, gid, rdev) = (p.mode & 0o7777, p.nlink, p.uid, p.gid, p.rdev);
    }
    let kind = file_type(a.kind);
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind,
        perm: perm as u16,
        nlink,
        uid,
        gid,
        rdev,
        flags: 0,
        blksize: 1 << 20,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_staging_disk_is_enospc_and_other_staging_failures_are_eio() {
        let stage = |code| FsError::Stage { path: "ckpt".into(), source: std::io::Error::from_raw_os_error(code) };
        assert_eq!(errno("write", &stage(nix::libc::ENOSPC)), Errno::ENOSPC);
        assert_eq!(errno("write", &stage(nix::libc::EDQUOT)), Errno::EDQUOT);
        assert_eq!(errno("write", &stage(nix::libc::EROFS)), Errno::EIO);
    }
}
