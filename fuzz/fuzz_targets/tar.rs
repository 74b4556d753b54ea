//! Any layer tar: indexed or refused with an error. A tar that indexes is written as eStargz,
//! and Strata's own reader must then find the footer and TOC of what was written.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::Cursor;
use strata_format::estargz::{decode_toc, parse_footer};
use strata_format::write::estargz_out::{Options, write};
use strata_format::write::plan::plan;
use strata_format::write::tar_index::index;

fuzz_target!(|data: &[u8]| {
    let Ok(entries) = index(Cursor::new(data)) else { return };
    let (order, _) = plan(&entries, &[]);
    let opts = Options { chunk_size: 4096, level: 1, ..Options::default() };
    let Ok((w, blob)) = write(&mut Cursor::new(data), &entries, &order, Vec::new(), opts, &|_| {}) else { return };
    let tail = &blob[blob.len().saturating_sub(51)..];
    let footer = parse_footer(tail, blob.len() as u64).expect("the footer just written");
    let member = &blob[footer.toc_offset as usize..footer.toc_end as usize];
    decode_toc(member, footer.compression, footer.data_end, &w.toc_digest, 64 << 20).expect("the TOC just written");
});
