//! A layer's tree from its TOC, built without fetching anything: what it refuses.

use super::*;
use crate::registry::hosts::Hosts;

fn layer_of(entries: serde_json::Value) -> Result<LayerNamespace, LayerError> {
    let json = serde_json::to_vec(&serde_json::json!({ "version": 1, "entries": entries })).unwrap();
    let toc = estargz::toc::parse_toc(&json, 1 << 20).unwrap();
    let registry = Arc::new(Registry::new(Hosts::new(None), Default::default()));
    let image = ImageRef::parse("127.0.0.1:5000/strata/x:1").unwrap();
    let blob = Arc::new(Blob::new(registry, image, format!("sha256:{}", "d".repeat(64)), 2 << 20));
    LayerNamespace::new(&toc, blob)
}

/// `.wh..` and `.wh...` would show a whiteout named `.` or `..` in the directory, which
/// overlayfs would take for the directory itself or its parent.
#[test]
fn a_whiteout_of_a_dot_name_is_refused() {
    for name in [".wh..", ".wh...", "etc/.wh..", "etc/.wh..."] {
        let e = layer_of(serde_json::json!([
            {"name": "etc/", "type": "dir", "mode": 0o755},
            {"name": name, "type": "reg", "size": 0},
        ]))
        .err()
        .unwrap_or_else(|| panic!("{name} was taken"));
        assert!(e.to_string().contains("a whiteout without a name"), "{name}: {e}");
    }
    assert!(layer_of(serde_json::json!([{"name": "etc/.wh.old", "type": "reg", "size": 0}])).is_ok());
}
