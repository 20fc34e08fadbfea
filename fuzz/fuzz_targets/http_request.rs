//! The HTTP API's request handling short of the server: routing (percent
//! decoding, method matching, slash redirects) and the JSON body parsers of
//! `/quota/{salt}`, `/cache/clear` and `/cache/checksums` (`kvshard-http-api`).
//!
//! kvshard parses request heads with hyper, which parses them with httparse;
//! this target does the same with httparse directly, so any byte string is a
//! request: a head that parses gives the method, target and `Host`, and the
//! bytes after it are the body. A head that does not parse still sends the
//! whole input to the body parsers.

#![no_main]

use http::{Method, Uri};
use kvshard_http_api::bodies::{parse_checksums, parse_clear, parse_limit_gb};
use kvshard_http_api::routes::{percent_decode, redirect_location, resolve, Resolved};
use libfuzzer_sys::fuzz_target;

/// hyper's default limit on request headers.
const MAX_HEADERS: usize = 100;

fuzz_target!(|data: &[u8]| {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let body = match req.parse(data) {
        Ok(httparse::Status::Complete(head_len)) => {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .and_then(|h| std::str::from_utf8(h.value).ok());
            route(
                req.method.unwrap_or_default(),
                req.path.unwrap_or_default(),
                host,
            );
            &data[head_len..]
        }
        _ => data,
    };
    parse(body);
});

/// Routes a request line as the server does; a line hyper would refuse is ignored.
fn route(method: &str, target: &str, host: Option<&str>) {
    let (Ok(method), Ok(uri)) = (Method::from_bytes(method.as_bytes()), target.parse::<Uri>())
    else {
        return;
    };
    let path = percent_decode(uri.path());
    match resolve(&method, &path) {
        Resolved::Found(_) => {}
        Resolved::MethodNotAllowed(allow) => assert!(!allow.is_empty()),
        Resolved::NotFound => {
            if let Some(location) = redirect_location(&path, uri.query(), host) {
                assert!(
                    location.starts_with('/') || location.starts_with("http://"),
                    "{location}"
                );
            }
        }
    }
}

/// Every body parser, and what each promises on success or refusal.
fn parse(body: &[u8]) {
    if let Ok(limit_gb) = parse_limit_gb(body) {
        assert!(limit_gb.is_finite() && limit_gb >= 0.0, "{limit_gb}");
    }
    if let Err(r) = parse_clear(body) {
        assert!(r.status.is_client_error(), "{r:?}");
    }
    // No block ids or no positive chunk size pass here: the front refuses
    // them once it has found the instance, as 0.5.6 does.
    if let Err(r) = parse_checksums(body) {
        assert!(r.status.is_client_error(), "{r:?}");
        assert!(r.body.get("detail").is_some(), "{r:?}");
    }
}
