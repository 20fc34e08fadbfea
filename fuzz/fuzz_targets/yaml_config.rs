//! `kvshard server --config FILE`: the YAML reader and its mapping onto flags
//! (`src/yaml_config.rs`, compiled in here as a module: it lives in the binary
//! crate and needs only serde_json).
//!
//! `parse_yaml` then `expand` is `load` without the file read, so no temporary
//! file is needed. A mapping that succeeds must give flag/value pairs whose
//! `--l2-adapter` value is a JSON object of type `s3`.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/yaml_config.rs"]
mod yaml_config;

fuzz_target!(|data: &[u8]| {
    // The file is read with `read_to_string`: only UTF-8 reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(entries) = yaml_config::parse_yaml(text) else {
        return;
    };
    let Ok(expanded) = yaml_config::expand(&entries) else {
        return;
    };
    let flags = &expanded.flags;
    assert!(flags.len() % 2 == 0, "flags come in pairs: {flags:?}");
    let mut adapters = 0;
    for pair in flags.chunks(2) {
        assert!(pair[0].starts_with("--"), "not a flag: {pair:?}");
        if pair[0] == "--l2-adapter" {
            adapters += 1;
            let spec: serde_json::Value =
                serde_json::from_str(&pair[1]).expect("the adapter is JSON");
            assert_eq!(spec["type"], "s3", "{spec}");
        }
    }
    assert_eq!(adapters, 1, "{flags:?}");
});
