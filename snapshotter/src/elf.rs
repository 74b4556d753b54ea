//! Just enough ELF to know what the dynamic loader will read when a program starts: the
//! interpreter it names, and the libraries in its dynamic section with where to look for them.
//! Only 64-bit little-endian files (x86-64, aarch64) are read; anything else, or anything
//! malformed, is simply not followed, since this only decides what to fetch early.

use std::ops::Range;

const MAGIC: &[u8; 4] = b"\x7fELF";
const CLASS64: u8 = 2;
const LITTLE_ENDIAN: u8 = 1;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const PHDR_SIZE: usize = 56;
const DYN_SIZE: usize = 16;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const DT_RPATH: u64 = 15;
const DT_RUNPATH: u64 = 29;
/// More than any real program links; a header claiming more is not followed past it.
const MAX_PHDRS: usize = 128;
const MAX_DYNAMIC: u64 = 64 << 10;
const MAX_STRTAB: u64 = 4 << 20;
const EM_X86_64: u16 = 62;
const EM_AARCH64: u16 = 183;

/// Whether `head` (a file's first bytes) starts like an ELF file.
pub fn is_elf(head: &[u8]) -> bool {
    head.starts_with(MAGIC)
}

/// What an ELF file's program headers say: its interpreter (when the headers and it are in the
/// bytes given), where its dynamic section is, and how addresses map to file offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    pub machine: u16,
    pub interp: Option<String>,
    /// File offsets of the dynamic section.
    pub dynamic: Option<Range<u64>>,
    /// Loadable segments: (virtual address, file offset, size in the file).
    loads: Vec<(u64, u64, u64)>,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

impl Headers {
    /// Parses the headers from a file's first bytes; `None` for what is not a dynamically
    /// loadable 64-bit little-endian ELF file, or whose program headers are not in `head`.
    pub fn parse(head: &[u8]) -> Option<Headers> {
        if !is_elf(head) || head.get(4) != Some(&CLASS64) || head.get(5) != Some(&LITTLE_ENDIAN) {
            return None;
        }
        let kind = u16_at(head, 16)?;
        if kind != ET_EXEC && kind != ET_DYN {
            return None;
        }
        let machine = u16_at(head, 18)?;
        let phoff = usize::try_from(u64_at(head, 32)?).ok()?;
        let phentsize = usize::from(u16_at(head, 54)?);
        let phnum = usize::from(u16_at(head, 56)?);
        if phentsize < PHDR_SIZE || phnum > MAX_PHDRS {
            return None;
        }
        let mut headers = Headers { machine, interp: None, dynamic: None, loads: Vec::new() };
        for i in 0..phnum {
            let ph = phoff.checked_add(i.checked_mul(phentsize)?)?;
            let kind = u32_at(head, ph)?;
            let offset = u64_at(head, ph + 8)?;
            let vaddr = u64_at(head, ph + 16)?;
            let filesz = u64_at(head, ph + 32)?;
            let end = offset.checked_add(filesz)?;
            match kind {
                PT_LOAD => headers.loads.push((vaddr, offset, filesz)),
                PT_DYNAMIC if filesz <= MAX_DYNAMIC => headers.dynamic = Some(offset..end),
                PT_INTERP => {
                    let bytes = head.get(usize::try_from(offset).ok()?..usize::try_from(end).ok()?);
                    headers.interp = bytes.and_then(c_string);
                }
                _ => {}
            }
        }
        Some(headers)
    }

    /// The file offset of virtual address `vaddr`, if a loadable segment holds it.
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|(start, _, size)| vaddr >= *start && vaddr - start < *size)
            .map(|(start, offset, _)| offset + (vaddr - start))
    }

    /// The directories the loader searches by default for this machine, as paths in an image
    /// (no leading `/`): Debian's multiarch ones first, then the traditional ones.
    pub fn default_dirs(&self) -> &'static [&'static str] {
        match self.machine {
            EM_X86_64 => &[
                "lib/x86_64-linux-gnu",
                "usr/lib/x86_64-linux-gnu",
                "lib64",
                "usr/lib64",
                "lib",
                "usr/lib",
                "usr/local/lib",
            ],
            EM_AARCH64 => &[
                "lib/aarch64-linux-gnu",
                "usr/lib/aarch64-linux-gnu",
                "lib64",
                "usr/lib64",
                "lib",
                "usr/lib",
                "usr/local/lib",
            ],
            _ => &["lib64", "usr/lib64", "lib", "usr/lib", "usr/local/lib"],
        }
    }
}

fn c_string(bytes: &[u8]) -> Option<String> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let s = std::str::from_utf8(&bytes[..end]).ok()?;
    (!s.is_empty()).then(|| s.to_owned())
}

/// A dynamic section: the string-table offsets of the libraries needed and of the search path,
/// and where the string table is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dynamic {
    needed: Vec<u64>,
    search: Option<u64>,
    /// File offsets of the string table.
    pub strtab: Option<Range<u64>>,
}

impl Dynamic {
    /// Parses the dynamic section's bytes; `headers` maps the string table's address.
    pub fn parse(bytes: &[u8], headers: &Headers) -> Dynamic {
        let mut dynamic = Dynamic::default();
        let (mut strtab, mut strsz, mut rpath, mut runpath) = (None, None, None, None);
        for entry in bytes.chunks_exact(DYN_SIZE) {
            let (Some(tag), Some(value)) = (u64_at(entry, 0), u64_at(entry, 8)) else { break };
            match tag {
                DT_NULL => break,
                DT_NEEDED => dynamic.needed.push(value),
                DT_STRTAB => strtab = Some(value),
                DT_STRSZ => strsz = Some(value),
                DT_RPATH => rpath = Some(value),
                DT_RUNPATH => runpath = Some(value),
                _ => {}
            }
        }
        // The loader ignores DT_RPATH when DT_RUNPATH is there.
        dynamic.search = runpath.or(rpath);
        if let (Some(addr), Some(size)) = (strtab, strsz.filter(|s| *s <= MAX_STRTAB))
            && let Some(offset) = headers.file_offset(addr)
        {
            dynamic.strtab = Some(offset..offset + size);
        }
        dynamic
    }

    /// The libraries needed, and the search path's directories, from the string table's bytes.
    pub fn names(&self, strtab: &[u8]) -> (Vec<String>, Vec<String>) {
        let at = |offset: u64| strtab.get(usize::try_from(offset).ok()?..).and_then(c_string);
        let needed = self.needed.iter().filter_map(|&o| at(o)).collect();
        let search = self
            .search
            .and_then(at)
            .map(|s| s.split(':').filter(|d| !d.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default();
        (needed, search)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small x86-64 executable: two loadable segments, an interpreter, a dynamic section
    /// needing two libraries with a run path, and the string table in the first segment.
    pub(crate) fn sample() -> Vec<u8> {
        let mut f = vec![0u8; 0x3000];
        f[..4].copy_from_slice(MAGIC);
        f[4] = CLASS64;
        f[5] = LITTLE_ENDIAN;
        f[16..18].copy_from_slice(&ET_DYN.to_le_bytes());
        f[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());
        f[32..40].copy_from_slice(&64u64.to_le_bytes());
        f[54..56].copy_from_slice(&(PHDR_SIZE as u16).to_le_bytes());
        f[56..58].copy_from_slice(&4u16.to_le_bytes());
        let mut ph = |i: usize, kind: u32, offset: u64, vaddr: u64, size: u64| {
            let at = 64 + i * PHDR_SIZE;
            f[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
            f[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
            f[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
        };
        ph(0, PT_INTERP, 0x200, 0x400200, 28);
        ph(1, PT_LOAD, 0, 0x400000, 0x1000);
        ph(2, PT_LOAD, 0x2000, 0x600000, 0x1000);
        ph(3, PT_DYNAMIC, 0x2800, 0x600800, 6 * DYN_SIZE as u64);
        f[0x200..0x21b].copy_from_slice(b"/lib64/ld-linux-x86-64.so.2");
        let strings = b"\0libm.so.6\0libc.so.6\0$ORIGIN/../lib:/opt/x\0";
        f[0x800..0x800 + strings.len()].copy_from_slice(strings);
        let entries = [
            (DT_NEEDED, 1),
            (DT_NEEDED, 11),
            (DT_RUNPATH, 21),
            (DT_STRTAB, 0x400800),
            (DT_STRSZ, strings.len() as u64),
            (DT_NULL, 0),
        ];
        for (i, (tag, value)) in entries.iter().enumerate() {
            let at = 0x2800 + i * DYN_SIZE;
            f[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
        }
        f
    }

    #[test]
    fn the_interpreter_libraries_and_run_path_are_read() {
        let f = sample();
        let h = Headers::parse(&f[..0x1000]).expect("headers in the first bytes");
        assert_eq!(h.interp.as_deref(), Some("/lib64/ld-linux-x86-64.so.2"));
        assert_eq!(h.dynamic, Some(0x2800..0x2860));
        assert_eq!(h.file_offset(0x600810), Some(0x2810));
        assert_eq!(h.file_offset(0x500000), None, "between segments");
        let d = Dynamic::parse(&f[0x2800..0x2860], &h);
        let strtab = d.strtab.clone().expect("the string table is mapped");
        assert_eq!(strtab.start, 0x800);
        let (needed, search) = d.names(&f[strtab.start as usize..strtab.end as usize]);
        assert_eq!(needed, ["libm.so.6", "libc.so.6"]);
        assert_eq!(search, ["$ORIGIN/../lib", "/opt/x"]);
        assert_eq!(h.default_dirs()[0], "lib/x86_64-linux-gnu");
    }

    #[test]
    fn what_is_not_a_dynamic_64_bit_elf_file_is_not_followed() {
        let f = sample();
        assert!(Headers::parse(b"#!/bin/sh\n").is_none());
        assert!(Headers::parse(&f[..40]).is_none(), "cut before the program headers");
        let mut object = f.clone();
        object[16] = 1; // ET_REL
        assert!(Headers::parse(&object).is_none());
        let mut big_endian = f.clone();
        big_endian[5] = 2;
        assert!(Headers::parse(&big_endian).is_none());
        let mut many = f.clone();
        many[56..58].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Headers::parse(&many).is_none());
        // A dynamic section with garbage tags and an unmapped string table names nothing.
        let h = Headers::parse(&f).unwrap();
        let d = Dynamic::parse(&[0xff; 48], &h);
        assert_eq!(d.names(b"").0, Vec::<String>::new());
        assert!(d.strtab.is_none());
    }

    #[test]
    fn a_real_program_on_this_machine_names_its_loader_and_libc() {
        let Ok(bytes) = std::fs::read("/bin/ls") else { panic!("/bin/ls is on every Debian machine") };
        let h = Headers::parse(&bytes).expect("ls is a dynamic ELF program");
        assert!(h.interp.as_deref().is_some_and(|i| i.contains("ld-linux")), "{h:?}");
        let dynamic = h.dynamic.clone().unwrap();
        let d = Dynamic::parse(&bytes[dynamic.start as usize..dynamic.end as usize], &h);
        let s = d.strtab.clone().unwrap();
        let (needed, _) = d.names(&bytes[s.start as usize..s.end as usize]);
        assert!(needed.iter().any(|n| n == "libc.so.6"), "{needed:?}");
    }
}
