//! Routing as lmcache 0.5.6's FastAPI app does it: Starlette's path matching in
//! registration order, 405 with the first matching route's `Allow`, and
//! `redirect_slashes`. 0.5.6's routes are all FastAPI `APIRoute`s, which (unlike
//! Starlette's plain `Route`) do not serve HEAD where they serve GET: HEAD is a
//! method like any other, 405 wherever a path exists.

use http::Method;

/// Path segment that stands for the empty (anonymous) cache salt, as in 0.5.6.
pub const DEFAULT_SALT_SENTINEL: &str = "_default";

/// What a route serves.
#[derive(Debug, Clone, PartialEq)]
pub enum Endpoint {
    Root,
    Healthcheck,
    Status,
    Version,
    LmcVersion,
    CommitId,
    Config,
    ConfigAdapters,
    CacheClear,
    CacheChecksums,
    /// The salt is already mapped from the `_default` sentinel.
    QuotaSet(String),
    QuotaGet(String),
    QuotaDelete(String),
    QuotaList,
    Metrics,
    MetricsReset,
    /// A 0.5.6 route that kvshard does not serve.
    NotImplemented,
}

/// Where a method and a decoded path lead.
#[derive(Debug, PartialEq)]
pub enum Resolved {
    Found(Endpoint),
    /// The path exists for these methods only (the `Allow` header, in order).
    MethodNotAllowed(Vec<Method>),
    NotFound,
}

/// Every (method, endpoint) served at a decoded path, `None` if no route matches it.
///
/// One entry per 0.5.6 route (each serves one method), in the order 0.5.6 registers
/// them: its routers are included in module-name order (`cache_api`, `common_api`,
/// `config_api`, `info_api`, `l1_reconfigure_api`, `quota_api`, `reconfigure_api`)
/// and each module's routes in decorator order, so `PUT /quota/{cache_salt}` comes
/// before its GET and DELETE, and `GET /reconfigure/{backend}/l2/status` before
/// `POST /reconfigure/{backend}/l2/{operation}`.
fn path_routes(path: &str) -> Option<Vec<(Method, Endpoint)>> {
    use Endpoint::*;
    let rest = path.strip_prefix('/')?;
    let segs: Vec<&str> = rest.split('/').collect();
    // A path parameter matches one non-empty segment, as Starlette's `{name}` does.
    let param = |s: &str| !s.is_empty();
    let get = |e: Endpoint| vec![(Method::GET, e)];
    let post = |e: Endpoint| vec![(Method::POST, e)];
    let routes = match segs.as_slice() {
        [""] => get(Root),
        ["healthcheck"] => get(Healthcheck),
        ["status"] => get(Status),
        ["version"] => get(Version),
        ["lmc_version"] => get(LmcVersion),
        ["commit_id"] => get(CommitId),
        ["config"] => get(Config),
        ["config", "adapters"] => get(ConfigAdapters),
        ["metrics"] => get(Metrics),
        ["metrics", "reset"] => post(MetricsReset),
        ["cache", "clear"] => post(CacheClear),
        ["cache", "checksums"] => post(CacheChecksums),
        ["quota"] => get(QuotaList),
        ["quota", salt] if param(salt) => {
            let salt = if *salt == DEFAULT_SALT_SENTINEL {
                String::new()
            } else {
                (*salt).to_string()
            };
            vec![
                (Method::PUT, QuotaSet(salt.clone())),
                (Method::GET, QuotaGet(salt.clone())),
                (Method::DELETE, QuotaDelete(salt)),
            ]
        }
        ["cache", "objects"] => vec![
            (Method::GET, NotImplemented),
            (Method::DELETE, NotImplemented),
        ],
        ["cache", "prefetches"] => post(NotImplemented),
        ["cache", "prefetches", id] if param(id) => get(NotImplemented),
        ["reconfigure", "dax", "l1", "status"] => get(NotImplemented),
        ["reconfigure", "dax", "l1", "add" | "remove"] => post(NotImplemented),
        ["reconfigure", backend, "l2", "status"] if param(backend) => {
            vec![
                (Method::GET, NotImplemented),
                (Method::POST, NotImplemented),
            ]
        }
        ["reconfigure", backend, "l2", op] if param(backend) && param(op) => post(NotImplemented),
        ["env" | "loglevel" | "threads" | "periodic-threads" | "periodic-threads-health"] => {
            get(NotImplemented)
        }
        ["periodic-threads", name] if param(name) => get(NotImplemented),
        _ => return None,
    };
    Some(routes)
}

/// Routes `method` at `path` (already [`percent_decode`]d) as Starlette's router
/// does: the first route serving `method` at the path answers; failing that, the
/// first route at the path (the router's first partial match) answers 405 with
/// `Allow` naming its methods only (one: every 0.5.6 route serves one method).
pub fn resolve(method: &Method, path: &str) -> Resolved {
    let Some(routes) = path_routes(path) else {
        return Resolved::NotFound;
    };
    if let Some((_, ep)) = routes.iter().find(|(m, _)| m == method) {
        return Resolved::Found(ep.clone());
    }
    Resolved::MethodNotAllowed(routes.into_iter().take(1).map(|(m, _)| m).collect())
}

/// `%XX` decoding as uvicorn does for the path Starlette routes on: invalid escapes
/// stay as they are, invalid UTF-8 becomes U+FFFD.
pub fn percent_decode(raw: &str) -> String {
    let b = raw.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Starlette's `redirect_slashes` for a path that routes nowhere: where a 307
/// sends `/status/` or `/status//` (to `/status`: every trailing slash goes) or
/// `/x` (to `/x/` if only that matched), `None` if the toggled path routes
/// nowhere either.
///
/// `path` is the decoded path, `query` the request target's and `host` its `Host`
/// header: with one, the location is absolute. As in Starlette, the location is
/// built from the decoded path (so `/status%2F` goes to `/status`), with `?`, `#`
/// and `\` escaped and then quoted as `RedirectResponse` quotes it.
pub fn redirect_location(path: &str, query: Option<&str>, host: Option<&str>) -> Option<String> {
    if path == "/" {
        return None;
    }
    let toggled = if path.ends_with('/') {
        path.trim_end_matches('/').to_string()
    } else {
        format!("{path}/")
    };
    path_routes(&toggled)?;
    // starlette.datastructures.URL(scope=...): scheme://netloc, the decoded path
    // with these three escaped, and `?query` unless the query is empty.
    let mut url = match host {
        Some(host) => format!("http://{host}"),
        None => String::new(),
    };
    url.push_str(
        &toggled
            .replace('?', "%3F")
            .replace('#', "%23")
            .replace('\\', "%5C"),
    );
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        url.push('?');
        url.push_str(q);
    }
    Some(quote_location(&url))
}

/// Python's `urllib.parse.quote(url, safe=":/%#?=@[]!$&'()*+,;")`, as Starlette's
/// `RedirectResponse` quotes its `Location`: UTF-8 bytes other than ASCII letters,
/// digits, `_.-~` and those become `%XX`. A `%` stays as it is.
fn quote_location(url: &str) -> String {
    const SAFE: &[u8] = b"_.-~:/%#?=@[]!$&'()*+,;";
    let mut out = String::with_capacity(url.len());
    for &b in url.as_bytes() {
        if b.is_ascii_alphanumeric() || SAFE.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_table() {
        assert!(
            matches!(resolve(&Method::GET, "/quota/_default"), Resolved::Found(Endpoint::QuotaGet(s)) if s.is_empty())
        );
        assert!(
            matches!(resolve(&Method::PUT, "/quota/x"), Resolved::Found(Endpoint::QuotaSet(s)) if s == "x")
        );
        assert_eq!(resolve(&Method::GET, "/quota/"), Resolved::NotFound);
        assert_eq!(
            resolve(&Method::POST, "/reconfigure/s3/l2/status"),
            Resolved::Found(Endpoint::NotImplemented)
        );
        assert_eq!(resolve(&Method::GET, "/run_script"), Resolved::NotFound);
        assert_eq!(
            resolve(&Method::PATCH, "/metrics/reset"),
            Resolved::MethodNotAllowed(vec![Method::POST])
        );
    }

    #[test]
    fn head_is_not_served_with_get() {
        // 0.5.6's routes are FastAPI APIRoutes: HEAD is 405 wherever GET is served.
        for path in [
            "/",
            "/status",
            "/healthcheck",
            "/metrics",
            "/config",
            "/config/adapters",
            "/quota",
            "/version",
        ] {
            assert_eq!(
                resolve(&Method::HEAD, path),
                Resolved::MethodNotAllowed(vec![Method::GET]),
                "{path}"
            );
        }
        assert_eq!(
            resolve(&Method::HEAD, "/quota/x"),
            Resolved::MethodNotAllowed(vec![Method::PUT])
        );
        assert_eq!(resolve(&Method::HEAD, "/nope"), Resolved::NotFound);
    }

    #[test]
    fn allow_names_the_first_route_at_the_path() {
        let allow =
            |m: &str, path: &str| match resolve(&Method::from_bytes(m.as_bytes()).unwrap(), path) {
                Resolved::MethodNotAllowed(a) => a
                    .iter()
                    .map(Method::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                other => panic!("{m} {path}: {other:?}"),
            };
        // As 0.5.6 answers (checked against its FastAPI app).
        for (m, path, want) in [
            ("POST", "/quota/x", "PUT"),
            ("PATCH", "/quota/_default", "PUT"),
            ("DELETE", "/status", "GET"),
            ("POST", "/status", "GET"),
            ("POST", "/cache/objects", "GET"),
            ("PUT", "/cache/objects", "GET"),
            ("OPTIONS", "/healthcheck", "GET"),
            ("GET", "/cache/clear", "POST"),
            ("GET", "/metrics/reset", "POST"),
            ("PUT", "/reconfigure/s3/l2/status", "GET"),
            ("GET", "/reconfigure/s3/l2/add", "POST"),
            ("GET", "/reconfigure/dax/l1/add", "POST"),
            ("POST", "/reconfigure/dax/l1/status", "GET"),
            ("DELETE", "/cache/prefetches/7", "GET"),
        ] {
            assert_eq!(allow(m, path), want, "{m} {path}");
        }
        // A later route serving the method still answers.
        assert_eq!(
            resolve(&Method::DELETE, "/quota/x"),
            Resolved::Found(Endpoint::QuotaDelete("x".into()))
        );
        assert_eq!(
            resolve(&Method::DELETE, "/cache/objects"),
            Resolved::Found(Endpoint::NotImplemented)
        );
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("/quota/a%20b%2"), "/quota/a b%2");
        assert_eq!(percent_decode("/x%zz%C3%A9%ff"), "/x%zzé\u{fffd}");
    }

    #[test]
    fn slash_redirects() {
        assert_eq!(
            redirect_location("/status/", Some("a=1"), Some("h:80")).as_deref(),
            Some("http://h:80/status?a=1")
        );
        assert_eq!(
            redirect_location("/quota/x/", None, None).as_deref(),
            Some("/quota/x")
        );
        assert_eq!(redirect_location("/nowhere/", None, None), None);
        assert_eq!(redirect_location("/nowhere", None, None), None);
        assert_eq!(redirect_location("/", None, None), None);
        assert_eq!(redirect_location("//", None, None), None);
        // Every trailing slash goes, as Python's rstrip("/") takes them.
        assert_eq!(
            redirect_location("/status//", None, Some("h")).as_deref(),
            Some("http://h/status")
        );
        assert_eq!(
            redirect_location("/quota//", None, Some("h")).as_deref(),
            Some("http://h/quota")
        );
        assert_eq!(
            redirect_location("/quota///", None, None).as_deref(),
            Some("/quota")
        );
        // An empty query adds no `?`.
        assert_eq!(
            redirect_location("/status/", Some(""), None).as_deref(),
            Some("/status")
        );
    }

    #[test]
    fn redirects_are_built_from_the_decoded_path() {
        // uvicorn decodes the path before Starlette sees it; Starlette escapes `?`,
        // `#` and `\` and quotes the rest as `RedirectResponse` does (these are
        // the locations uvicorn + 0.5.6's app sent).
        let at = |raw: &str, query: Option<&str>| {
            let path = percent_decode(raw);
            redirect_location(&path, query, Some("test.local"))
        };
        for (raw, want) in [
            ("/status%2F", "http://test.local/status"),
            ("/status%2F%2F", "http://test.local/status"),
            ("/quota%2F_default%2F", "http://test.local/quota/_default"),
            ("/quota/a%20b/", "http://test.local/quota/a%20b"),
            ("/quota/%C3%A9/", "http://test.local/quota/%C3%A9"),
            ("/quota/a%3Fb/", "http://test.local/quota/a%3Fb"),
            ("/quota/a%23b/", "http://test.local/quota/a%23b"),
            ("/quota/a%5Cb/", "http://test.local/quota/a%5Cb"),
            ("/quota/a%22b/", "http://test.local/quota/a%22b"),
            ("/quota/a%7Bb/", "http://test.local/quota/a%7Bb"),
            ("/quota/a%25b/", "http://test.local/quota/a%b"),
            ("/quota/%ff/", "http://test.local/quota/%EF%BF%BD"),
            ("/quota/a'b/", "http://test.local/quota/a'b"),
            ("/quota/a;b/", "http://test.local/quota/a;b"),
        ] {
            assert_eq!(at(raw, None).as_deref(), Some(want), "{raw}");
        }
        assert_eq!(
            at("/status/", Some("a=%20b&c")).as_deref(),
            Some("http://test.local/status?a=%20b&c")
        );
        // An encoded slash inside a segment splits it, as uvicorn's decoding does.
        assert_eq!(at("/quota/a%2Fb/", None), None);
        assert_eq!(at("/%2Fstatus/", None), None);
    }
}
