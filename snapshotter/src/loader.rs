//! The files a dynamically linked program's loader will read, fetched as soon as the program's
//! first bytes arrive. Starting `python3` from a layer with no prefetch region reads the
//! binary, then its ELF interpreter, then `/etc/ld.so.cache`, then each library it links, one
//! after another: a registry round trip each, on the link lazy pulls are for. The binary's
//! headers name all of them, so they are asked for at once, side by side, and the libraries'
//! own dependencies are followed the same way when their bytes come in. A name is looked for in
//! the program's own layer first, then in the layers under it in its snapshot chain, nearest
//! first (an application layer's program linking the base layer's libc). What the program
//! reads next at start, besides, is named by `startup`. The chunks are checked against their
//! TOC like any other, and each file is asked for once per layer.

use crate::elf::{Dynamic, Headers};
use crate::fetch::LayerFetcher;
use crate::layer::{Blob, FileData, LayerNamespace, Tree};
use crate::startup;
use bytes::Bytes;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};
use strata_tiering::{ChunkKey, GetOptions, TieredCache};

/// The lazy layers open on the node, by digest, so that a program in one layer has its
/// libraries found in the layers under it. Layers are held weakly: an unmounted one drops out.
#[derive(Debug, Default)]
pub struct Layers(Mutex<HashMap<String, Held>>);

/// A layer as [`Layers`] holds it.
type Held = (Weak<Blob>, Weak<Tree>);

impl Layers {
    /// Records an open layer.
    pub fn add(&self, ns: &LayerNamespace) {
        let (blob, tree) = ns.parts();
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|_, (b, _)| b.strong_count() > 0);
        open.insert(blob.digest.clone(), (Arc::downgrade(blob), Arc::downgrade(tree)));
    }

    /// Where to look past `blob`'s own layer: the open layers under it, nearest first, as its
    /// snapshot chain says (whatever image they were pulled for).
    fn under(&self, blob: &Blob) -> Vec<(Arc<Blob>, Arc<Tree>)> {
        let Some(lower) = blob.lower.get() else { return Vec::new() };
        let open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        lower.iter().filter_map(|d| open.get(d)).filter_map(|(b, t)| Some((b.upgrade()?, t.upgrade()?))).collect()
    }
}

/// A file found for a name: its layer, and its chunks there.
struct Found {
    blob: Arc<Blob>,
    tree: Arc<Tree>,
    file: Arc<FileData>,
}

/// The file `name` names, in the layer of `blob` first, then in the layers under it.
fn find(blob: &Arc<Blob>, tree: &Arc<Tree>, name: &str) -> Option<Found> {
    if let Some(file) = tree.resolve(name) {
        return Some(Found { blob: blob.clone(), tree: tree.clone(), file });
    }
    blob.layers
        .under(blob)
        .into_iter()
        .find_map(|(blob, tree)| tree.resolve(name).map(|file| Found { blob, tree, file }))
}

/// Libraries followed from one file at most.
const MAX_NEEDED: usize = 64;
/// Files followed in one layer at most: a layer of many programs started one after another
/// still fetches only what their starts read, but no more than this ahead of them.
const MAX_FOLLOWED: usize = 1024;
/// Of a file fetched ahead, the chunks within this many bytes from its start: its headers and
/// dynamic section, and the code a start runs, for all but the largest libraries.
pub(crate) const AHEAD_BYTES: u64 = 8 << 20;
/// Chunks fetched ahead at once, on the whole node: what bounds their memory when a program
/// links dozens of large libraries (a machine-learning framework's, say).
static AHEAD_AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(8);
/// Small files ([`startup::SMALL`]) fetched ahead at once, besides those: at most 1 MiB.
static SMALL_AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(16);
/// Files scanned at once for the paths they name (a chunk each in memory). Not the slots above:
/// a scan waits for chunks that fetches holding those are bringing.
static SCANS_AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);
/// What glibc's loader reads before any library.
const LD_CACHE: &str = "etc/ld.so.cache";

/// Follows the ELF file at `path` in the layer, whose first chunk `head` has just been fetched
/// (or its first bytes, unchecked): fetches what its loader will read, in the background, and,
/// if it was itself fetched ahead of a start (`ahead_of_start`), the small files it names.
pub(crate) fn follow(blob: &Arc<Blob>, tree: &Arc<Tree>, path: &str, head: Bytes, ahead_of_start: bool) {
    let Some(cache) = blob.cache.get().cloned() else { return };
    let Some(headers) = Headers::parse(&head) else { return };
    let (blob, tree, path) = (blob.clone(), tree.clone(), path.to_owned());
    tokio::spawn(async move {
        // The interpreter and its cache are named in the first bytes; ask for them before
        // reading the dynamic section, which may be in a chunk still on its way.
        if let Some(interp) = &headers.interp {
            ahead(&blob, &tree, &cache, interp);
            ahead(&blob, &tree, &cache, LD_CACHE);
        }
        // When the dynamic section is not in these bytes, the string table's library names are
        // taken at their word until it comes: what it does not name is a few libraries'
        // bytes fetched for nothing, where waiting costs the link's time for the rest of the
        // file first.
        if headers.dynamic.as_ref().is_some_and(|d| d.end > head.len() as u64) {
            for name in startup::library_names(&head) {
                if let Some(path) = in_dirs(&blob, &tree, headers.default_dirs(), &name) {
                    ahead(&blob, &tree, &cache, &path);
                }
            }
        }
        let Some(file) = tree.resolve(&path) else { return };
        interpreter_start(&blob, &tree, &cache, &file.path);
        for name in needed(&blob, &tree, &cache, &file, &headers, &head).await {
            ahead(&blob, &tree, &cache, &name);
        }
        // Last, since it waits for all of the file: the small files it names. Only for a file
        // fetched ahead for a start (a library: the C library is what names them), not one a
        // reader opened, which may be `cat` on a walk through the layer, not a start.
        if !ahead_of_start {
            return;
        }
        // A chunk at a time, a few files at a time: a start that links dozens of large
        // libraries holds no more than that in memory for this.
        let Ok(_slot) = SCANS_AT_ONCE.acquire().await else { return };
        let (len, size) = (file_len(&file).min(AHEAD_BYTES), tree.chunk_size);
        for index in 0..len.div_ceil(size) {
            let range = index * size..((index + 1) * size).min(len);
            let Some(bytes) = read(&blob, &tree, &cache, &file, range, &head).await else { return };
            for name in startup::named_paths(&bytes) {
                ahead_small(&blob, &tree, &cache, &name);
            }
        }
    });
}

fn file_len(file: &FileData) -> u64 {
    file.chunks.last().map_or(0, |c| c.file_offset + c.size)
}

/// The paths of the libraries `file` needs, found as the loader would search them (see [`find`]).
async fn needed(
    blob: &Arc<Blob>,
    tree: &Arc<Tree>,
    cache: &TieredCache,
    file: &Arc<FileData>,
    headers: &Headers,
    head: &Bytes,
) -> Vec<String> {
    let Some(range) = headers.dynamic.clone() else { return Vec::new() };
    let Some(section) = read(blob, tree, cache, file, range, head).await else { return Vec::new() };
    let dynamic = Dynamic::parse(&section, headers);
    let Some(strtab) = dynamic.strtab.clone() else { return Vec::new() };
    let Some(strings) = read(blob, tree, cache, file, strtab, head).await else { return Vec::new() };
    let (names, search) = dynamic.names(&strings);
    let origin = file.path.rsplit_once('/').map_or("", |(dir, _)| dir);
    let dirs: Vec<String> = search
        .iter()
        .map(|d| d.replace("${ORIGIN}", &format!("/{origin}")).replace("$ORIGIN", &format!("/{origin}")))
        // Other expansions ($LIB, $PLATFORM) depend on the running machine; not guessed.
        .filter(|d| !d.contains('$'))
        .chain(headers.default_dirs().iter().map(|d| (*d).to_owned()))
        .collect();
    names
        .iter()
        .take(MAX_NEEDED)
        .filter_map(|name| {
            if name.contains('/') {
                return Some(name.clone());
            }
            in_dirs(blob, tree, &dirs, name)
        })
        .collect()
}

/// The path of library `name` in the first of `dirs` that holds it, as the loader searches.
fn in_dirs(blob: &Arc<Blob>, tree: &Arc<Tree>, dirs: &[impl AsRef<str>], name: &str) -> Option<String> {
    dirs.iter().map(|d| format!("{}/{name}", d.as_ref())).find(|p| find(blob, tree, p).is_some())
}

/// Bytes `range` of `file`, from `head` (its first chunk) or through the cache: a chunk a
/// reader is fetching now is waited for, not fetched again.
async fn read(
    blob: &Arc<Blob>,
    tree: &Arc<Tree>,
    cache: &TieredCache,
    file: &Arc<FileData>,
    range: Range<u64>,
    head: &Bytes,
) -> Option<Bytes> {
    if range.end <= head.len() as u64 {
        return Some(head.slice(range.start as usize..range.end as usize));
    }
    let size = tree.chunk_size;
    let mut out = bytes::BytesMut::new();
    for index in range.start / size..range.end.div_ceil(size) {
        let chunk = file.chunks.get(index as usize)?;
        let start = range.start.max(index * size) - index * size;
        let end = range.end.min((index + 1) * size) - index * size;
        let key = ChunkKey::digest(file.path.clone(), chunk.digest.clone());
        match cache.get_range(&key, fetcher(blob, tree, file), start..end).await {
            Ok(bytes) => out.extend_from_slice(&bytes),
            Err(e) => {
                tracing::debug!(layer = %blob.digest, path = %file.path, error = %e, "an ELF file's dynamic section was not read");
                return None;
            }
        }
    }
    Some(out.freeze())
}

fn fetcher(blob: &Arc<Blob>, tree: &Arc<Tree>, file: &Arc<FileData>) -> Arc<LayerFetcher> {
    Arc::new(LayerFetcher { blob: blob.clone(), file: Some(file.clone()), tree: tree.clone(), ahead: true })
}

/// Fetches what an interpreter's start reads of its own, known by its path (`real`, symlinks
/// followed) alone.
fn interpreter_start(blob: &Arc<Blob>, tree: &Arc<Tree>, cache: &TieredCache, real: &str) {
    for (name, instead) in startup::python_start(real) {
        if !ahead(blob, tree, cache, &name)
            && let Some(instead) = instead
        {
            ahead(blob, tree, cache, &instead);
        }
    }
}

/// Fetches the start of the program at `path` in the layer of `ns` (not the layers under it:
/// theirs have their own mounts), and so, once its first chunk is in, what its loader will
/// read. `false` if the layer holds no such file.
pub(crate) fn start_program(ns: &LayerNamespace, path: &str) -> bool {
    let (blob, tree) = ns.parts();
    let Some(cache) = blob.cache.get() else { return false };
    let Some(file) = tree.resolve(path) else { return false };
    tracing::debug!(layer = %blob.digest, path, "fetching the image's program ahead");
    let _ = ahead(blob, tree, cache, path);
    // Its own start-up files need none of its bytes to be named, so they go out beside it.
    interpreter_start(blob, tree, cache, &file.path);
    true
}

/// Fetches the file `name` names (see [`find`]) if it is a small one, as [`ahead`] does.
fn ahead_small(blob: &Arc<Blob>, tree: &Arc<Tree>, cache: &TieredCache, name: &str) {
    if find(blob, tree, name).is_some_and(|f| file_len(&f.file) <= startup::SMALL) {
        ahead(blob, tree, cache, name);
    }
}

/// Fetches the start of the file `name` names (see [`find`]), unless it was asked for
/// already. Its first chunk's arrival follows it in turn, if it is an ELF file. `false` if the
/// layers hold no such file.
fn ahead(blob: &Arc<Blob>, tree: &Arc<Tree>, cache: &TieredCache, name: &str) -> bool {
    let (from, from_tree) = (blob, tree);
    let Some(Found { blob, tree, file }) = find(blob, tree, name) else { return false };
    let (blob, tree) = (&blob, &tree);
    {
        let mut followed = blob.followed.lock().unwrap_or_else(|p| p.into_inner());
        if followed.len() >= MAX_FOLLOWED || !followed.insert(file.path.clone()) {
            return true;
        }
    }
    let keys: Vec<ChunkKey> = file
        .chunks
        .iter()
        .filter(|c| c.file_offset < AHEAD_BYTES)
        .map(|c| ChunkKey::digest(file.path.clone(), c.digest.clone()))
        .filter(|k| cache.location(k).is_none())
        .collect();
    fetch_chunks(blob, tree, cache, &file, keys);
    // The C library's start-up files go out right behind it, not once its bytes have named
    // them. They are looked for from where the program is, as its reads will be.
    for name in startup::glibc_start(&file.path) {
        ahead_small(from, from_tree, cache, &name);
    }
    true
}

/// Fetches `keys`, chunks of `file`, in the background, a slot each.
fn fetch_chunks(blob: &Arc<Blob>, tree: &Arc<Tree>, cache: &TieredCache, file: &Arc<FileData>, keys: Vec<ChunkKey>) {
    if keys.is_empty() {
        return;
    }
    blob.rejects.loader_files.inc();
    tracing::debug!(layer = %blob.digest, path = %file.path, chunks = keys.len(), "fetching ahead for a starting program");
    // A small file does not wait behind the libraries' large chunks: its fetch is a round trip,
    // not bytes, and it is the next thing a start reads, one after another.
    let slots = if file_len(file) <= startup::SMALL { &SMALL_AT_ONCE } else { &AHEAD_AT_ONCE };
    for key in keys {
        let (cache, fetcher) = (cache.clone(), fetcher(blob, tree, file));
        let digest = blob.digest.clone();
        tokio::spawn(async move {
            let Ok(_slot) = slots.acquire().await else { return };
            // A failure here is the reader's to meet, when it asks for the chunk itself.
            if let Err(e) = cache.get(&key, fetcher, GetOptions::default()).await {
                tracing::debug!(layer = %digest, key = %key, error = %e, "a file fetched ahead for a loader was not fetched");
            }
        });
    }
}
