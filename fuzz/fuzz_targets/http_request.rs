//! The HTTP API's request handling short of the front: routing (percent
//! decoding, method matching, slash redirects) and the JSON body parsers of
//! `/quota/{salt}`, `/cache/clear` and `/cache/checksums`
//! (`kvshard_http::fuzz_parse`).
//!
//! kvshard parses request heads with hyper, which parses them with httparse;
//! this target does the same with httparse directly, so any byte string is a
//! request: a head that parses gives the method, target and `Host`, and the
//! bytes after it are the body. A head that does not parse still sends the
//! whole input to the body parsers.

#![no_main]

use libfuzzer_sys::fuzz_target;

/// hyper's default limit on request headers.
const MAX_HEADERS: usize = 100;

fuzz_target!(|data: &[u8]| {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    match req.parse(data) {
        Ok(httparse::Status::Complete(head_len)) => {
            let method = req.method.unwrap_or_default().as_bytes();
            let target = req.path.unwrap_or_default().as_bytes();
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .map(|h| h.value);
            kvshard_http::fuzz_parse(method, target, host, &data[head_len..]);
        }
        _ => kvshard_http::fuzz_parse(b"POST", b"/cache/checksums", None, data),
    }
});
