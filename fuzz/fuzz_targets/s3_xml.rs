//! s3-raw's XML reader and every typed S3/STS response parser on top of it.
//!
//! The whole input goes to `parse_bytes` (which checks UTF-8 itself); when it
//! is UTF-8, to each typed parser as well, and its lines, as ETags, through
//! the CompleteMultipartUpload writer and back through the reader.

#![no_main]

use kvshard_s3_raw::xml::{self, CompletedPart};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tree = xml::parse_bytes(data);
    let Ok(text) = std::str::from_utf8(data) else {
        assert!(tree.is_err(), "non-UTF-8 input parsed");
        return;
    };
    // The two entry points agree.
    assert_eq!(tree.is_ok(), xml::parse(text).is_ok());
    let _ = xml::parse_list_objects_v2(text);
    let _ = xml::parse_error(text);
    let _ = xml::parse_create_session(text);
    let _ = xml::parse_assume_role_with_web_identity(text);
    let _ = xml::parse_sts_error(text);
    let _ = xml::parse_initiate_multipart_upload(text);
    complete_round_trip(text);
});

/// A body the writer accepts reads back with the same parts.
fn complete_round_trip(text: &str) {
    let parts: Vec<CompletedPart> = text
        .split('\n')
        .take(8)
        .zip(1..)
        .map(|(etag, part_number)| CompletedPart {
            part_number,
            etag: etag.to_string(),
        })
        .collect();
    let mut body = String::new();
    if xml::write_complete_multipart_upload(&parts, &mut body).is_err() {
        return;
    }
    let root = xml::parse(&body).expect("the writer's body parses");
    assert_eq!(root.name(), "CompleteMultipartUpload");
    let read: Vec<(&str, &str)> = root
        .children_named("Part")
        .map(|p| {
            let field = |name| p.children_named(name).next().map_or("", |e| e.text());
            (field("PartNumber"), field("ETag"))
        })
        .collect();
    assert_eq!(read.len(), parts.len());
    for ((number, etag), part) in read.iter().zip(&parts) {
        assert_eq!(*number, part.part_number.to_string());
        assert_eq!(*etag, part.etag, "ETag changed on the way through XML");
    }
}
