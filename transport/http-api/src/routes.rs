//! Routing as lmcache 0.5.6's FastAPI app does it: Starlette's path matching,
//! HEAD wherever GET is served, 405 with `Allow`, and `redirect_slashes`.

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

/// Routes `method` at `path` (already [`percent_decode`]d).
pub fn resolve(method: &Method, path: &str) -> Resolved {
    let Some(routes) = path_routes(path) else {
        return Resolved::NotFound;
    };
    // Starlette serves HEAD wherever it serves GET.
    let wanted = if method == Method::HEAD {
        &Method::GET
    } else {
        method
    };
    if let Some((_, ep)) = routes.iter().find(|(m, _)| m == wanted) {
        return Resolved::Found(ep.clone());
    }
    let mut allow: Vec<Method> = Vec::new();
    for (m, _) in &routes {
        if !allow.contains(m) {
            allow.push(m.clone());
        }
        if *m == Method::GET && !allow.contains(&Method::HEAD) {
            allow.push(Method::HEAD);
        }
    }
    Resolved::MethodNotAllowed(allow)
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
/// sends `/status/` (to `/status`) or `/x` (to `/x/` if only that matched),
/// `None` if the toggled path routes nowhere either.
///
/// `path` is the decoded path, `raw_path` and `query` the request target's, and
/// `host` its `Host` header: with one, the location is absolute.
pub fn redirect_location(
    path: &str,
    raw_path: &str,
    query: Option<&str>,
    host: Option<&str>,
) -> Option<String> {
    if path == "/" {
        return None;
    }
    let toggled = match path.strip_suffix('/') {
        Some(p) => p.to_string(),
        None => format!("{path}/"),
    };
    path_routes(&toggled)?;
    let mut location = match raw_path.strip_suffix('/') {
        Some(p) => p.to_string(),
        None => format!("{raw_path}/"),
    };
    if let Some(q) = query {
        location.push('?');
        location.push_str(q);
    }
    if let Some(host) = host {
        location = format!("http://{host}{location}");
    }
    Some(location)
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
            resolve(&Method::HEAD, "/metrics"),
            Resolved::Found(Endpoint::Metrics)
        );
        assert_eq!(
            resolve(&Method::PATCH, "/metrics/reset"),
            Resolved::MethodNotAllowed(vec![Method::POST])
        );
        assert_eq!(
            resolve(&Method::POST, "/status"),
            Resolved::MethodNotAllowed(vec![Method::GET, Method::HEAD])
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
            redirect_location("/status/", "/status/", Some("a=1"), Some("h:80")).as_deref(),
            Some("http://h:80/status?a=1")
        );
        assert_eq!(
            redirect_location("/quota/x/", "/quota/x/", None, None).as_deref(),
            Some("/quota/x")
        );
        assert_eq!(
            redirect_location("/nowhere/", "/nowhere/", None, None),
            None
        );
        assert_eq!(redirect_location("/", "/", None, None), None);
    }
}
