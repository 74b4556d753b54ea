//! Any daemon config and any tier policy, as TOML text: validated, or an error naming the key;
//! never a panic. A policy that parses is shown (`strata tier policy show`) as TOML that parses
//! back to the same policy, so what an operator copies from `show` into `set` is taken.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_tiering::Policy;
use strata_tiering::config::Config;

const PATHS: [&str; 4] = ["datasets/imagenet/train/shard-0001.tar", "ckpt/step-1000/model.pt", "", "a"];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = Config::from_toml(text) {
        let _ = c.cache_config(Policy::default());
    }
    if let Ok(p) = Policy::from_toml(text) {
        let shown = p.to_toml();
        let back = Policy::from_toml(&shown).unwrap_or_else(|e| panic!("{shown}\ndoes not parse back: {e}"));
        for path in PATHS {
            assert_eq!(p.resolve(path), back.resolve(path), "{path:?} under\n{shown}");
        }
    }
});
