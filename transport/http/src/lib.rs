//! The HTTP API, routed like lmcache 0.5.6's FastAPI app (`lmcache server`'s
//! `--http-host/--http-port`) for the endpoints kvshard implements.
//!
//! Everything that reads or changes server state is a [`ControlRequest`] to the front
//! thread; this module only routes, validates bodies the way 0.5.6 does (FastAPI's 422
//! for the model-typed bodies of `/cache/*`, the hand-written 400s of `/quota`), and
//! shapes the answers.
//!
//! Differences from 0.5.6, on purpose:
//! - 0.5.6 routes kvshard does not implement (`/cache/objects`, `/cache/prefetches`,
//!   `/reconfigure/...`, the debug routes `/env`, `/threads`, ...)
//!   answer 501 with a message saying so, rather than pretending to be absent.
//!   `/run_script` is 404 for every method: kvshard never runs scripts.
//! - Request bodies are limited to [`MAX_BODY_BYTES`] (413), and bodies and control
//!   calls have a deadline ([`HttpInfo::control_timeout`]).
//! - A JSON body is parsed whatever its content type (FastAPI ignores a body that is
//!   not declared JSON and then fails validation with 422).

use std::convert::Infallible;
use std::error::Error as StdError;
use std::io;
use std::rc::Rc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Body;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};

use kvshard_io::http::{Conn, HttpServeConfig, HttpStats};
use kvshard_io::timeout::with_timeout;

use kvshard_control::control::ControlHandle;
use kvshard_control::metrics::{ProcessLimits, ProcessSample, PromText};
use kvshard_dataplane::messages::{ControlBody, ControlRequest, ControlResponse};

/// Request bodies larger than this are refused with 413. The largest legitimate body
/// is a `/cache/checksums` block list: 1 MiB holds well over 100k block ids.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Default for [`HttpInfo::control_timeout`].
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// Path segment that stands for the empty (anonymous) cache salt, as in 0.5.6.
const DEFAULT_SALT_SENTINEL: &str = "_default";

/// An early answer from body parsing (boxed: responses are large).
type Reject = Box<Response<Full<Bytes>>>;

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Static facts the HTTP API reports.
#[derive(Debug, Clone)]
pub struct HttpInfo {
    /// `GET /lmc_version`; empty shows as `NA` in `GET /version`.
    pub version: String,
    /// `GET /commit_id`; empty shows as `NA` in `GET /version`.
    pub commit_id: String,
    /// How long a request may take to send its body, and how long the front may take
    /// to answer a control request, before the client gets 408 / 504.
    pub control_timeout: Duration,
    /// Connections kept open at once (see [`HttpServeConfig::max_connections`]).
    pub max_connections: usize,
}

impl HttpInfo {
    pub fn new(version: impl Into<String>, commit_id: impl Into<String>) -> Self {
        HttpInfo {
            version: version.into(),
            commit_id: commit_id.into(),
            control_timeout: DEFAULT_CONTROL_TIMEOUT,
            max_connections: HttpServeConfig::default().max_connections,
        }
    }
}

struct Ctx {
    control: ControlHandle,
    info: Rc<HttpInfo>,
    /// This server's connection counters, appended to `/metrics`.
    stats: Rc<HttpStats>,
}

/// Serves the HTTP API on `listener` until accepting fails. Runs inside a glommio
/// executor; each connection is a task on it. Idle or slow clients cannot make
/// others wait: see [`HttpServeConfig`] for the bounds.
pub async fn serve(
    listener: glommio::net::TcpListener,
    control: ControlHandle,
    info: Rc<HttpInfo>,
) -> io::Result<()> {
    let cfg = HttpServeConfig {
        max_connections: info.max_connections,
        ..HttpServeConfig::default()
    };
    let stats = Rc::new(HttpStats::default());
    let ctx = Rc::new(Ctx {
        control,
        info,
        stats: stats.clone(),
    });
    kvshard_io::http::serve_http1_with(listener, cfg, stats, move |conn| {
        let (ctx, conn) = (ctx.clone(), conn.clone());
        hyper::service::service_fn(move |req| {
            let (ctx, conn) = (ctx.clone(), conn.clone());
            async move { Ok::<_, Infallible>(handle(req, &ctx, &conn).await) }
        })
    })
    .await
}

// ------------------------------------------------------------------ routing

#[derive(Debug, Clone, PartialEq)]
enum Endpoint {
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

enum Resolved {
    Found(Endpoint),
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

fn resolve(method: &Method, path: &str) -> Resolved {
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
fn percent_decode(raw: &str) -> String {
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

// ------------------------------------------------------------------ handling

async fn handle<B>(req: Request<B>, ctx: &Ctx, conn: &Conn) -> Response<Full<Bytes>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let path = percent_decode(req.uri().path());
    match resolve(req.method(), &path) {
        Resolved::Found(ep) => endpoint(ep, req, ctx, conn).await,
        Resolved::MethodNotAllowed(allow) => {
            let allow = allow
                .iter()
                .map(Method::as_str)
                .collect::<Vec<_>>()
                .join(", ");
            let mut resp = detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
            if let Ok(v) = HeaderValue::from_str(&allow) {
                resp.headers_mut().insert(header::ALLOW, v);
            }
            resp
        }
        Resolved::NotFound => slash_redirect(&req, &path)
            .unwrap_or_else(|| detail(StatusCode::NOT_FOUND, "Not Found")),
    }
}

/// Starlette's `redirect_slashes`: `/status/` answers 307 to `/status` (and `/x` to
/// `/x/` if only that matched).
fn slash_redirect<B>(req: &Request<B>, path: &str) -> Option<Response<Full<Bytes>>> {
    if path == "/" {
        return None;
    }
    let toggled = match path.strip_suffix('/') {
        Some(p) => p.to_string(),
        None => format!("{path}/"),
    };
    path_routes(&toggled)?;
    let raw = req.uri().path();
    let mut location = match raw.strip_suffix('/') {
        Some(p) => p.to_string(),
        None => format!("{raw}/"),
    };
    if let Some(q) = req.uri().query() {
        location.push('?');
        location.push_str(q);
    }
    if let Some(host) = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
    {
        location = format!("http://{host}{location}");
    }
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::TEMPORARY_REDIRECT;
    let value = HeaderValue::from_str(&location).ok()?;
    resp.headers_mut().insert(header::LOCATION, value);
    Some(resp)
}

async fn endpoint<B>(ep: Endpoint, req: Request<B>, ctx: &Ctx, conn: &Conn) -> Response<Full<Bytes>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let info = &ctx.info;
    match ep {
        // Literal bytes keep 0.5.6's key order (serde_json sorts keys).
        Endpoint::Root => json_bytes(
            StatusCode::OK,
            br#"{"status":"ok","service":"LMCache HTTP API"}"#.to_vec(),
        ),
        Endpoint::Healthcheck => {
            let r = call(ctx, ControlRequest::Status).await;
            // A status that answers but says unhealthy (a shard stopped) is unhealthy.
            let said_unhealthy = matches!(
                &r.body,
                ControlBody::Json(v) if v.get("is_healthy") == Some(&Value::Bool(false))
            );
            if r.status == 200 && !said_unhealthy {
                json_bytes(StatusCode::OK, br#"{"status":"healthy"}"#.to_vec())
            } else {
                let reason = Value::String(failure_reason(&r));
                // Built by hand to keep 0.5.6's key order.
                let body = format!(r#"{{"status":"unhealthy","reason":{reason}}}"#);
                json_bytes(StatusCode::SERVICE_UNAVAILABLE, body.into_bytes())
            }
        }
        Endpoint::Status => {
            control_response(call(ctx, ControlRequest::Status).await, JsonStyle::Compact)
        }
        Endpoint::Version => {
            let or_na = |s: &str| {
                if s.is_empty() {
                    "NA".to_string()
                } else {
                    s.to_string()
                }
            };
            let v = format!("{}-{}", or_na(&info.version), or_na(&info.commit_id));
            json_response(StatusCode::OK, &Value::String(v))
        }
        Endpoint::LmcVersion => json_response(StatusCode::OK, &Value::String(info.version.clone())),
        Endpoint::CommitId => json_response(StatusCode::OK, &Value::String(info.commit_id.clone())),
        // 0.5.6 renders /config with indent=2 for reading by people.
        Endpoint::Config => {
            control_response(call(ctx, ControlRequest::Config).await, JsonStyle::Pretty)
        }
        Endpoint::ConfigAdapters => control_response(
            call(ctx, ControlRequest::ConfigAdapters).await,
            JsonStyle::Pretty,
        ),
        Endpoint::Metrics => {
            let mut r = call(ctx, ControlRequest::Metrics).await;
            if let (200, ControlBody::Text(text)) = (r.status, &mut r.body) {
                render_http_stats(text, &ctx.stats, ctx.info.max_connections);
                render_process_stats(text);
            }
            let exposition = r.status == 200 && matches!(r.body, ControlBody::Text(_));
            let mut resp = control_response(r, JsonStyle::Compact);
            if exposition {
                set_content_type(&mut resp, PROMETHEUS_TEXT);
            }
            resp
        }
        Endpoint::MetricsReset => {
            let r = call(ctx, ControlRequest::ResetMetrics).await;
            // 0.5.6 answers a plain-text "ok".
            if r.status == 200 {
                text_response(StatusCode::OK, "ok", TEXT)
            } else {
                control_response(r, JsonStyle::Compact)
            }
        }
        Endpoint::CacheClear => {
            let body = match read_body(req, ctx, conn).await {
                Ok(b) => b,
                Err(resp) => return *resp,
            };
            match parse_clear(&body) {
                Ok(force) => control_response(
                    call(ctx, ControlRequest::Clear { force }).await,
                    JsonStyle::Compact,
                ),
                Err(resp) => *resp,
            }
        }
        Endpoint::CacheChecksums => {
            let body = match read_body(req, ctx, conn).await {
                Ok(b) => b,
                Err(resp) => return *resp,
            };
            match parse_checksums(&body) {
                Ok(r) => control_response(call(ctx, r).await, JsonStyle::Compact),
                Err(resp) => *resp,
            }
        }
        Endpoint::QuotaSet(cache_salt) => {
            let body = match read_body(req, ctx, conn).await {
                Ok(b) => b,
                Err(resp) => return *resp,
            };
            match parse_limit_gb(&body) {
                Ok(limit_gb) => {
                    let r = call(
                        ctx,
                        ControlRequest::QuotaSet {
                            cache_salt,
                            limit_gb,
                        },
                    )
                    .await;
                    control_response(escape_salts(r, false), JsonStyle::Compact)
                }
                Err(msg) => json_response(StatusCode::BAD_REQUEST, &json!({ "error": msg })),
            }
        }
        Endpoint::QuotaGet(cache_salt) => {
            let r = call(ctx, ControlRequest::QuotaGet { cache_salt }).await;
            control_response(escape_salts(r, false), JsonStyle::Compact)
        }
        Endpoint::QuotaDelete(cache_salt) => {
            let r = call(ctx, ControlRequest::QuotaDelete { cache_salt }).await;
            control_response(escape_salts(r, false), JsonStyle::Compact)
        }
        Endpoint::QuotaList => {
            let r = call(ctx, ControlRequest::QuotaList).await;
            control_response(escape_salts(r, true), JsonStyle::Compact)
        }
        Endpoint::NotImplemented => {
            let msg = format!(
                "{} {} is an lmcache 0.5.6 endpoint that kvshard does not implement",
                req.method(),
                req.uri().path()
            );
            detail(StatusCode::NOT_IMPLEMENTED, &msg)
        }
    }
}

async fn call(ctx: &Ctx, req: ControlRequest) -> ControlResponse {
    let limit = ctx.info.control_timeout;
    with_timeout(limit, ctx.control.call(req))
        .await
        .unwrap_or_else(|| {
            kvshard_io::log_limited!(
                log::Level::Warn,
                "http: the front did not answer a control request within {limit:?}"
            );
            ControlResponse::error(
                504,
                format!("the server did not answer within {} ms", limit.as_millis()),
            )
        })
}

/// This server's `kvshard_http_*` series, in the front's exposition format.
fn render_http_stats(text: &mut String, stats: &HttpStats, max_connections: usize) {
    let mut t = PromText::default();
    t.gauge(
        "kvshard_http_connections_open",
        "HTTP API connections open",
        stats.open.get() as f64,
    );
    t.gauge(
        "kvshard_http_connections_max",
        "HTTP API connections kept open at most",
        max_connections as f64,
    );
    t.counter(
        "kvshard_http_connections_accepted_total",
        "HTTP API connections accepted",
        stats.accepted.get(),
    );
    t.counter(
        "kvshard_http_connections_shed_total",
        "HTTP API connections closed to make room while they waited on their client",
        stats.shed.get(),
    );
    t.counter(
        "kvshard_http_connections_refused_total",
        "HTTP API clients answered 503 because every connection was being answered",
        stats.refused.get(),
    );
    t.counter(
        "kvshard_http_header_timeouts_total",
        "HTTP API connections closed because the client did not send its headers in time",
        stats.header_timeouts.get(),
    );
    text.push_str(&t.finish());
}

/// The standard `process_*` series, read from /proc here on the HTTP thread.
fn render_process_stats(text: &mut String) {
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let mut nofile = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid out-pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let limits = ProcessLimits {
        // A failed sysconf (-1) becomes 0, which leaves the times out.
        clock_ticks_per_second: u64::try_from(hz).unwrap_or(0),
        max_fds: (rc == 0 && nofile.rlim_cur != libc::RLIM_INFINITY).then_some(nofile.rlim_cur),
    };
    let mut t = PromText::default();
    ProcessSample::read(limits).render(&mut t);
    text.push_str(&t.finish());
}

/// Reads the whole body, bounded in size and time. The wait counts as time
/// spent on the client: the connection may be shed meanwhile when the server is full.
async fn read_body<B>(req: Request<B>, ctx: &Ctx, conn: &Conn) -> Result<Bytes, Reject>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let too_large = || {
        let msg = format!("request body larger than {MAX_BODY_BYTES} bytes");
        let mut resp = detail(StatusCode::PAYLOAD_TOO_LARGE, &msg);
        // The unread rest of the body makes the connection unusable.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        resp
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(Box::new(too_large()));
    }
    let limit = ctx.info.control_timeout;
    let collected = conn
        .client_paced(with_timeout(
            limit,
            Limited::new(req.into_body(), MAX_BODY_BYTES).collect(),
        ))
        .await;
    match collected {
        None => {
            let msg = format!("request body not received within {} ms", limit.as_millis());
            let mut resp = detail(StatusCode::REQUEST_TIMEOUT, &msg);
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(Box::new(resp))
        }
        Some(Ok(c)) => Ok(c.to_bytes()),
        Some(Err(e)) if e.is::<LengthLimitError>() => Err(Box::new(too_large())),
        Some(Err(e)) => Err(Box::new(detail(
            StatusCode::BAD_REQUEST,
            &format!("error reading the request body: {e}"),
        ))),
    }
}

// ------------------------------------------------------------------ responses

#[derive(Clone, Copy)]
enum JsonStyle {
    Compact,
    Pretty,
}

fn json_response(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    json_bytes(status, serde_json::to_vec(v).unwrap_or_default())
}

fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    set_content_type(&mut resp, JSON);
    resp
}

fn text_response(
    status: StatusCode,
    text: &str,
    content_type: &'static str,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::copy_from_slice(text.as_bytes())));
    *resp.status_mut() = status;
    set_content_type(&mut resp, content_type);
    resp
}

fn set_content_type(resp: &mut Response<Full<Bytes>>, ct: &'static str) {
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
}

/// FastAPI's `HTTPException` shape.
fn detail(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    json_response(status, &json!({ "detail": msg }))
}

fn control_response(r: ControlResponse, style: JsonStyle) -> Response<Full<Bytes>> {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    // `ControlHandle::call` has rendered it already; a body still to render
    // would be rendered here.
    match r.rendered().body {
        ControlBody::Json(v) => {
            let bytes = match style {
                JsonStyle::Compact => serde_json::to_vec(&v),
                JsonStyle::Pretty => serde_json::to_vec_pretty(&v),
            };
            json_bytes(status, bytes.unwrap_or_default())
        }
        ControlBody::Text(t) => text_response(status, &t, TEXT),
        ControlBody::Render(_) => detail(
            StatusCode::INTERNAL_SERVER_ERROR,
            "a control answer rendered to another answer to render",
        ),
    }
}

/// What a failed control answer says, for `/healthcheck`'s `reason`.
fn failure_reason(r: &ControlResponse) -> String {
    match &r.body {
        ControlBody::Json(v) => ["detail", "error", "reason", "unhealthy_reason"]
            .iter()
            .find_map(|k| v.get(*k).and_then(Value::as_str))
            .map(str::to_string)
            .unwrap_or_else(|| match r.status {
                200 => "the server reports itself unhealthy".to_string(),
                s => format!("status request failed with HTTP {s}"),
            }),
        ControlBody::Text(t) if !t.is_empty() => t.clone(),
        ControlBody::Text(_) | ControlBody::Render(_) => {
            format!("status request failed with HTTP {}", r.status)
        }
    }
}

/// The empty salt is shown as the `_default` sentinel in quota answers, as in 0.5.6
/// (the front speaks real salts).
fn escape_salts(mut r: ControlResponse, list: bool) -> ControlResponse {
    if let ControlBody::Json(Value::Object(obj)) = &mut r.body {
        if list {
            if let Some(Value::Object(users)) = obj.get_mut("users") {
                if let Some(v) = users.remove("") {
                    users.insert(DEFAULT_SALT_SENTINEL.to_string(), v);
                }
            }
        } else if obj.get("cache_salt").and_then(Value::as_str) == Some("") {
            obj.insert(
                "cache_salt".to_string(),
                Value::String(DEFAULT_SALT_SENTINEL.to_string()),
            );
        }
    }
    r
}

// ------------------------------------------------------------------ body parsing

/// `json.loads`: like serde_json, plus Python's bare `NaN`, `Infinity` and
/// `-Infinity`, which are turned into strings that read back as the same floats
/// wherever 0.5.6 then calls `float()`.
fn python_json(body: &[u8]) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(first) => {
            let Ok(text) = std::str::from_utf8(body) else {
                return Err(first);
            };
            match quote_nonfinite_literals(text) {
                Some(fixed) => serde_json::from_str(&fixed).map_err(|_| first),
                None => Err(first),
            }
        }
    }
}

/// Rewrites bare `NaN` / `Infinity` / `-Infinity` tokens outside strings into quoted
/// strings; `None` if there were none.
fn quote_nonfinite_literals(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len() + 8);
    let mut in_string = false;
    let mut escaped = false;
    let mut changed = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else {
            let token = ["-Infinity", "Infinity", "NaN"]
                .into_iter()
                .find(|t| rest.starts_with(t));
            if let Some(t) = token {
                out.push('"');
                out.push_str(t);
                out.push('"');
                rest = &rest[t.len()..];
                changed = true;
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    changed.then_some(out)
}

/// `float(x)` for a JSON value, as `PUT /quota` applies it.
fn python_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        Value::String(s) => python_float_str(s),
        _ => None,
    }
}

/// Python's `float(str)`: surrounding whitespace, `_` between digits, `inf`/`nan`.
fn python_float_str(s: &str) -> Option<f64> {
    let s = s.trim();
    let b = s.as_bytes();
    let mut cleaned = String::with_capacity(s.len());
    for (i, &c) in b.iter().enumerate() {
        if c == b'_' {
            let digit_before = i > 0 && b[i - 1].is_ascii_digit();
            let digit_after = b.get(i + 1).is_some_and(u8::is_ascii_digit);
            if !(digit_before && digit_after) {
                return None;
            }
            continue;
        }
        cleaned.push(c as char);
    }
    // Rust's grammar (sign, digits, '.', exponent, inf/infinity/nan in any case) is
    // Python's once the underscores are gone.
    cleaned.parse::<f64>().ok()
}

/// `PUT /quota/{salt}`'s hand-written checks, with 0.5.6's messages.
fn parse_limit_gb(body: &[u8]) -> Result<f64, &'static str> {
    let v = python_json(body).map_err(|_| "invalid JSON body")?;
    let Some(raw) = v.as_object().and_then(|o| o.get("limit_gb")) else {
        return Err("body must be {'limit_gb': <float>}");
    };
    let limit_gb = python_float(raw).ok_or("limit_gb must be numeric")?;
    if !limit_gb.is_finite() {
        return Err("limit_gb must be finite");
    }
    if limit_gb < 0.0 {
        return Err("limit_gb must be non-negative");
    }
    Ok(limit_gb)
}

/// FastAPI's validation error: 422 `{"detail": [{type, loc, msg, input}, ...]}`.
fn validation_error(errors: Vec<Value>) -> Response<Full<Bytes>> {
    json_response(
        StatusCode::UNPROCESSABLE_ENTITY,
        &json!({ "detail": errors }),
    )
}

fn verr(kind: &str, loc: &[Value], msg: &str, input: &Value) -> Value {
    let mut full = vec![json!("body")];
    full.extend_from_slice(loc);
    json!({ "type": kind, "loc": full, "msg": msg, "input": input })
}

/// A FastAPI model body: `Ok(None)` when absent (empty or `null`), 422 when not JSON.
fn model_body(body: &[u8]) -> Result<Option<Value>, Reject> {
    if body.is_empty() {
        return Ok(None);
    }
    match python_json(body) {
        Ok(Value::Null) => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            let pos = byte_offset(body, e.line(), e.column());
            Err(Box::new(validation_error(vec![json!({
                "type": "json_invalid",
                "loc": ["body", pos],
                "msg": "JSON decode error",
                "input": {},
                "ctx": { "error": e.to_string() },
            })])))
        }
    }
}

fn byte_offset(body: &[u8], line: usize, column: usize) -> usize {
    let mut offset = 0;
    for (i, l) in body.split(|b| *b == b'\n').enumerate() {
        if i + 1 == line {
            return (offset + column.saturating_sub(1)).min(body.len());
        }
        offset += l.len() + 1;
    }
    body.len()
}

fn model_object<'a>(
    v: &'a Value,
    class: &str,
    errors: &mut Vec<Value>,
) -> Option<&'a Map<String, Value>> {
    let obj = v.as_object();
    if obj.is_none() {
        errors.push(json!({
            "type": "dataclass_type",
            "loc": ["body"],
            "msg": format!("Input should be a dictionary or an instance of {class}"),
            "input": v,
            "ctx": { "class_name": class },
        }));
    }
    obj
}

/// pydantic's lax `bool`.
fn lax_bool(v: &Value, loc: &[Value], errors: &mut Vec<Value>) -> Option<bool> {
    let parsing = "Input should be a valid boolean, unable to interpret input";
    match v {
        Value::Bool(b) => return Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => return Some(false),
            Some(1.0) => return Some(true),
            _ => errors.push(verr("bool_parsing", loc, parsing, v)),
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => return Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => return Some(true),
            _ => errors.push(verr("bool_parsing", loc, parsing, v)),
        },
        _ => errors.push(verr("bool_type", loc, "Input should be a valid boolean", v)),
    }
    None
}

/// An integer that pydantic's lax `int` accepts but that may not fit an i64.
enum LaxInt {
    Fits(i64),
    /// Valid for pydantic, outside i64; keeps the JSON text for messages.
    Huge {
        negative: bool,
        text: String,
    },
}

fn lax_int(v: &Value, loc: &[Value], errors: &mut Vec<Value>) -> Option<LaxInt> {
    let fractional = "Input should be a valid integer, got a number with a fractional part";
    let from_f64 = |x: f64, errors: &mut Vec<Value>| -> Option<LaxInt> {
        if !x.is_finite() {
            errors.push(verr(
                "finite_number",
                loc,
                "Input should be a finite number",
                v,
            ));
            None
        } else if x.fract() != 0.0 {
            errors.push(verr("int_from_float", loc, fractional, v));
            None
        } else if (i64::MIN as f64..-(i64::MIN as f64)).contains(&x) {
            Some(LaxInt::Fits(x as i64))
        } else {
            Some(LaxInt::Huge {
                negative: x < 0.0,
                text: format!("{x:.0}"),
            })
        }
    };
    match v {
        Value::Bool(b) => Some(LaxInt::Fits(i64::from(*b))),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Some(LaxInt::Fits(i))
            } else if let Some(u) = n.as_u64() {
                Some(LaxInt::Huge {
                    negative: false,
                    text: u.to_string(),
                })
            } else {
                from_f64(n.as_f64().unwrap_or(f64::NAN), errors)
            }
        }
        Value::String(s) => {
            let t = s.trim();
            let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
            if !digits.is_empty() && digits.bytes().all(|c| c.is_ascii_digit()) {
                match t.parse::<i64>() {
                    Ok(i) => Some(LaxInt::Fits(i)),
                    Err(_) => Some(LaxInt::Huge {
                        negative: t.starts_with('-'),
                        text: t.to_string(),
                    }),
                }
            } else {
                errors.push(verr(
                    "int_parsing",
                    loc,
                    "Input should be a valid integer, unable to parse string as an integer",
                    v,
                ));
                None
            }
        }
        _ => {
            errors.push(verr("int_type", loc, "Input should be a valid integer", v));
            None
        }
    }
}

/// `POST /cache/clear`'s optional `ClearRequest {tier = "l1", force = false}`.
fn parse_clear(body: &[u8]) -> Result<bool, Reject> {
    let Some(v) = model_body(body)? else {
        return Ok(false);
    };
    let mut errors = Vec::new();
    let Some(obj) = model_object(&v, "ClearRequest", &mut errors) else {
        return Err(Box::new(validation_error(errors)));
    };
    let mut tier = "l1".to_string();
    if let Some(t) = obj.get("tier") {
        match t.as_str() {
            Some(s @ ("l1" | "l2" | "all")) => tier = s.to_string(),
            _ => errors.push(json!({
                "type": "enum",
                "loc": ["body", "tier"],
                "msg": "Input should be 'l1', 'l2' or 'all'",
                "input": t,
                "ctx": { "expected": "'l1', 'l2' or 'all'" },
            })),
        }
    }
    let force = match obj.get("force") {
        Some(f) => lax_bool(f, &[json!("force")], &mut errors).unwrap_or(false),
        None => false,
    };
    if !errors.is_empty() {
        return Err(Box::new(validation_error(errors)));
    }
    if tier != "l1" {
        let msg = format!("tier '{tier}' not supported; only 'l1'");
        return Err(Box::new(detail(StatusCode::BAD_REQUEST, &msg)));
    }
    Ok(force)
}

/// `POST /cache/checksums`' required `ChecksumRequest {block_ids = [], chunk_size = 0,
/// instance_id = 0, layerwise = false}`.
///
/// 0.5.6 looks the instance up (404) before checking `block_ids` and `chunk_size`
/// (400); here those two are checked first, because the control request cannot carry
/// a non-positive chunk size.
fn parse_checksums(body: &[u8]) -> Result<ControlRequest, Reject> {
    let Some(v) = model_body(body)? else {
        return Err(Box::new(validation_error(vec![json!({
            "type": "missing", "loc": ["body"], "msg": "Field required", "input": null,
        })])));
    };
    let mut errors = Vec::new();
    let Some(obj) = model_object(&v, "ChecksumRequest", &mut errors) else {
        return Err(Box::new(validation_error(errors)));
    };

    let mut block_ids: Vec<LaxInt> = Vec::new();
    if let Some(b) = obj.get("block_ids") {
        match b.as_array() {
            Some(items) => {
                for (i, item) in items.iter().enumerate() {
                    if let Some(x) = lax_int(item, &[json!("block_ids"), json!(i)], &mut errors) {
                        block_ids.push(x);
                    }
                }
            }
            None => errors.push(verr(
                "list_type",
                &[json!("block_ids")],
                "Input should be a valid list",
                b,
            )),
        }
    }
    let mut int_field = |name: &str| {
        obj.get(name)
            .map(|x| lax_int(x, &[json!(name)], &mut errors))
    };
    let chunk_size = int_field("chunk_size");
    let instance_id = int_field("instance_id");
    let layerwise = match obj.get("layerwise") {
        Some(l) => lax_bool(l, &[json!("layerwise")], &mut errors).unwrap_or(false),
        None => false,
    };
    if !errors.is_empty() {
        return Err(Box::new(validation_error(errors)));
    }

    // With no errors reported, `None` means the field was absent (its default applies).
    let instance_id = match instance_id.flatten() {
        None => 0,
        Some(LaxInt::Fits(i)) => i,
        // No registration can have an id outside i64.
        Some(LaxInt::Huge { text, .. }) => {
            return Err(Box::new(detail(
                StatusCode::NOT_FOUND,
                &format!("instance_id {text} not registered"),
            )));
        }
    };
    if block_ids.is_empty() {
        return Err(Box::new(detail(
            StatusCode::BAD_REQUEST,
            "block_ids is required",
        )));
    }
    let chunk_size_blocks = match chunk_size.flatten() {
        Some(LaxInt::Fits(i)) if i > 0 => usize::try_from(i).unwrap_or(usize::MAX),
        Some(LaxInt::Huge {
            negative: false, ..
        }) => usize::MAX,
        _ => 0,
    };
    if chunk_size_blocks == 0 {
        return Err(Box::new(detail(
            StatusCode::BAD_REQUEST,
            "chunk_size must be positive",
        )));
    }
    let mut ids = Vec::with_capacity(block_ids.len());
    for b in block_ids {
        match b {
            LaxInt::Fits(i) => ids.push(i),
            LaxInt::Huge { text, .. } => {
                return Err(Box::new(detail(
                    StatusCode::BAD_REQUEST,
                    &format!("block id {text} is out of range"),
                )));
            }
        }
    }
    Ok(ControlRequest::Checksums {
        instance_id,
        block_ids: ids,
        chunk_size_blocks,
        layerwise,
    })
}

/// For `fuzz/fuzz_targets/http_request.rs` only: everything this module does with
/// a request that hyper has parsed, short of calling the front. Routes `method`
/// and `target` (with the `Host` header, for redirects) as `handle` does, and
/// gives `body` to every body parser, checking what each promises on success.
/// A request line hyper would refuse is ignored.
#[doc(hidden)]
pub fn fuzz_parse(method: &[u8], target: &[u8], host: Option<&[u8]>, body: &[u8]) {
    let mut builder = Request::builder().method(method).uri(target);
    if let Some(host) = host {
        builder = builder.header(header::HOST, host);
    }
    if let Ok(req) = builder.body(()) {
        let path = percent_decode(req.uri().path());
        match resolve(req.method(), &path) {
            Resolved::Found(_) => {}
            Resolved::MethodNotAllowed(allow) => assert!(!allow.is_empty()),
            Resolved::NotFound => {
                if let Some(resp) = slash_redirect(&req, &path) {
                    assert!(resp.headers().contains_key(header::LOCATION));
                }
            }
        }
    }
    if let Ok(limit_gb) = parse_limit_gb(body) {
        assert!(limit_gb.is_finite() && limit_gb >= 0.0, "{limit_gb}");
    }
    let _ = parse_clear(body);
    if let Ok(r) = parse_checksums(body) {
        let ControlRequest::Checksums {
            block_ids,
            chunk_size_blocks,
            ..
        } = r
        else {
            panic!("parse_checksums made {r:?}");
        };
        assert!(!block_ids.is_empty() && chunk_size_blocks > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvshard_dataplane::messages::FrontEvent;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::sync::OnceLock;

    const TEST_TIMEOUT: Duration = Duration::from_millis(300);

    /// The canned answers of the fake front; `None` holds the responder forever.
    fn answer(req: ControlRequest) -> Option<ControlResponse> {
        let j = ControlResponse::json;
        Some(match req {
            // Rendered by the receiver, as the front answers these two; the
            // status says which thread rendered it.
            ControlRequest::Status => ControlResponse::render(|| {
                ControlBody::Json(json!({
                    "is_healthy": true,
                    "engine_type": "MPCacheServer",
                    "rendered_on": std::thread::current().name(),
                }))
            }),
            ControlRequest::Config => j(json!({"mp": {"port": 5555}})),
            ControlRequest::ConfigAdapters => j(json!({"adapters": []})),
            ControlRequest::Metrics => ControlResponse::render(|| {
                ControlBody::Text("# TYPE x counter\nx_total 1\n".into())
            }),
            ControlRequest::ResetMetrics => j(json!({"status": "ok"})),
            ControlRequest::Clear { force } => {
                j(json!({"status": "ok", "cleared": {"tier": "l1"}, "force": force}))
            }
            ControlRequest::QuotaSet {
                cache_salt,
                limit_gb,
            } => j(json!({"cache_salt": cache_salt, "limit_gb": limit_gb, "status": "ok"})),
            ControlRequest::QuotaGet { cache_salt } if cache_salt == "hang" => return None,
            ControlRequest::QuotaGet { cache_salt } => j(
                json!({"cache_salt": cache_salt, "limit_gb": 0.0, "current_usage_gb": 0.0, "exists": false}),
            ),
            ControlRequest::QuotaDelete { cache_salt } => {
                j(json!({"cache_salt": cache_salt, "status": "not_found"}))
            }
            ControlRequest::QuotaList => j(json!({"users": {
                "": {"limit_gb": 1.0, "current_usage_gb": 0.0},
                "bob": {"limit_gb": 2.0, "current_usage_gb": 0.5},
            }})),
            ControlRequest::Checksums {
                instance_id,
                block_ids,
                chunk_size_blocks,
                layerwise,
            } => j(json!({
                "instance_id": instance_id, "block_ids": block_ids,
                "chunk_size": chunk_size_blocks, "layerwise": layerwise,
            })),
        })
    }

    /// Serves the API on a shard thread; the front answers from `answer` when
    /// `with_front`, else it is gone (every control call fails).
    fn start_server(with_front: bool) -> SocketAddr {
        let (tx, mut rx) = kvshard_io::mailbox::notify_queue::<FrontEvent>();
        if with_front {
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut events = Vec::new();
                loop {
                    let mut pfd = libc::pollfd {
                        fd: rx.fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd for the duration of the call.
                    unsafe { libc::poll(&mut pfd, 1, 100) };
                    rx.drain(&mut events);
                    for ev in events.drain(..) {
                        if let FrontEvent::Control(req, responder) = ev {
                            match answer(req) {
                                Some(r) => responder.send(r),
                                None => held.push(responder),
                            }
                        }
                    }
                }
            });
        } else {
            drop(rx);
        }
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let shard = kvshard_io::executor::spawn_shard(
            0,
            None,
            "kvs-http-api-test".into(),
            move || async move {
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                let info = HttpInfo {
                    version: "0.1.0".into(),
                    commit_id: "abc123".into(),
                    control_timeout: TEST_TIMEOUT,
                    max_connections: 64,
                };
                serve(listener, ControlHandle::new(tx), Rc::new(info))
                    .await
                    .unwrap();
            },
        )
        .unwrap();
        drop(shard); // detached: it serves until the test process exits
        addr_rx.recv().unwrap()
    }

    fn server() -> SocketAddr {
        static ADDR: OnceLock<SocketAddr> = OnceLock::new();
        *ADDR.get_or_init(|| start_server(true))
    }

    #[derive(Debug)]
    struct Resp {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Resp {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }

        fn json(&self) -> Value {
            assert_eq!(self.header("content-type"), Some(JSON), "{self:?}");
            serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
        }
    }

    fn exchange(addr: SocketAddr, raw: &[u8]) -> Resp {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The server may answer and close before taking all of an oversized body.
        let _ = s.write_all(raw);
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8(buf).unwrap();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("no response head: {text:?}"));
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers = lines
            .map(|l| {
                let (k, v) = l.split_once(':').unwrap();
                (k.trim().to_string(), v.trim().to_string())
            })
            .collect();
        Resp {
            status,
            headers,
            body: body.to_string(),
        }
    }

    fn req(method: &str, path: &str, body: Option<&str>) -> Resp {
        req_at(server(), method, path, body)
    }

    fn req_at(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Resp {
        let mut raw =
            format!("{method} {path} HTTP/1.1\r\nHost: test.local\r\nConnection: close\r\n");
        if let Some(b) = body {
            raw.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
                b.len()
            ));
        } else {
            raw.push_str("\r\n");
        }
        exchange(addr, raw.as_bytes())
    }

    #[test]
    fn a_status_that_says_unhealthy_gives_the_healthcheck_reason() {
        let r = ControlResponse::json(
            json!({"is_healthy": false, "unhealthy_reason": "shard(s) [1] stopped"}),
        );
        assert_eq!(failure_reason(&r), "shard(s) [1] stopped");
        let r = ControlResponse::json(json!({"is_healthy": false}));
        assert_eq!(failure_reason(&r), "the server reports itself unhealthy");
    }

    #[test]
    fn info_routes() {
        let r = req("GET", "/", None);
        assert_eq!(r.status, 200);
        assert_eq!(
            r.json(),
            json!({"status": "ok", "service": "LMCache HTTP API"})
        );
        assert_eq!(r.body, r#"{"status":"ok","service":"LMCache HTTP API"}"#);
        let r = req("GET", "/healthcheck", None);
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, r#"{"status":"healthy"}"#)
        );
        assert_eq!(req("GET", "/version", None).json(), json!("0.1.0-abc123"));
        assert_eq!(req("GET", "/lmc_version", None).json(), json!("0.1.0"));
        assert_eq!(req("GET", "/commit_id", None).json(), json!("abc123"));
        let head = req("HEAD", "/", None);
        assert_eq!(head.status, 200);
        assert!(head.body.is_empty());
    }

    #[test]
    fn status_config_metrics() {
        let r = req("GET", "/status", None);
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["engine_type"], "MPCacheServer");
        // The front's snapshot is rendered on the HTTP executor's thread.
        assert_eq!(r.json()["rendered_on"], "kvs-http-api-test");
        let r = req("GET", "/config", None);
        assert_eq!(r.json(), json!({"mp": {"port": 5555}}));
        assert!(
            r.body.contains("\n  \"mp\": {\n    \"port\": 5555"),
            "indented like 0.5.6: {}",
            r.body
        );
        let r = req("GET", "/metrics", None);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some(PROMETHEUS_TEXT));
        // The front's exposition, then this server's own connection series.
        let (front, http) = r.body.split_at("# TYPE x counter\nx_total 1\n".len());
        assert_eq!(front, "# TYPE x counter\nx_total 1\n");
        assert!(
            http.contains("\nkvshard_http_connections_max 64\n"),
            "{http}"
        );
        for name in [
            "kvshard_http_connections_open",
            "kvshard_http_connections_accepted_total",
            "kvshard_http_connections_shed_total",
            "kvshard_http_connections_refused_total",
            "kvshard_http_header_timeouts_total",
        ] {
            assert!(http.contains(&format!("# TYPE {name} ")), "{name}: {http}");
        }
        let r = req("POST", "/metrics/reset", None);
        assert_eq!((r.status, r.body.as_str()), (200, "ok"));
        assert_eq!(r.header("content-type"), Some(TEXT));
    }

    #[test]
    fn cache_clear_bodies() {
        let ok = |body: Option<&str>, force: bool| {
            let r = req("POST", "/cache/clear", body);
            assert_eq!(r.status, 200, "{body:?}: {r:?}");
            assert_eq!(
                r.json(),
                json!({"status": "ok", "cleared": {"tier": "l1"}, "force": force}),
                "{body:?}"
            );
        };
        ok(None, false);
        ok(Some(""), false);
        ok(Some("null"), false);
        ok(Some("{}"), false);
        ok(Some(r#"{"tier":"l1","force":true}"#), true);
        ok(Some(r#"{"force":"yes"}"#), true);
        ok(Some(r#"{"force":0,"extra":1}"#), false);

        let r = req("POST", "/cache/clear", Some(r#"{"tier":"l2"}"#));
        assert_eq!(
            (r.status, r.json()),
            (400, json!({"detail": "tier 'l2' not supported; only 'l1'"}))
        );
        let r = req("POST", "/cache/clear", Some(r#"{"tier":"all"}"#));
        assert_eq!(r.status, 400);

        let r = req(
            "POST",
            "/cache/clear",
            Some(r#"{"tier":"l3","force":"maybe"}"#),
        );
        assert_eq!(r.status, 422);
        let d = r.json()["detail"].clone();
        assert_eq!(d[0]["type"], "enum");
        assert_eq!(d[0]["loc"], json!(["body", "tier"]));
        assert_eq!(d[1]["type"], "bool_parsing");
        assert_eq!(d[1]["loc"], json!(["body", "force"]));

        let r = req("POST", "/cache/clear", Some("{\"tier\":"));
        assert_eq!(r.status, 422);
        assert_eq!(r.json()["detail"][0]["type"], "json_invalid");
        assert_eq!(r.json()["detail"][0]["loc"][0], "body");

        let r = req("POST", "/cache/clear", Some("[1]"));
        assert_eq!(r.status, 422);
        assert_eq!(r.json()["detail"][0]["type"], "dataclass_type");
    }

    #[test]
    fn cache_checksums_bodies() {
        let r = req(
            "POST",
            "/cache/checksums",
            Some(
                r#"{"block_ids":[3,4,"5",6.0,true],"chunk_size":2,"instance_id":7,"layerwise":1}"#,
            ),
        );
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.json(),
            json!({"instance_id": 7, "block_ids": [3, 4, 5, 6, 1], "chunk_size": 2, "layerwise": true})
        );
        let r = req(
            "POST",
            "/cache/checksums",
            Some(r#"{"block_ids":[1],"chunk_size":1}"#),
        );
        assert_eq!(
            r.json(),
            json!({"instance_id": 0, "block_ids": [1], "chunk_size": 1, "layerwise": false})
        );

        let r = req("POST", "/cache/checksums", None);
        assert_eq!(
            (r.status, r.json()["detail"][0]["type"].clone()),
            (422, json!("missing"))
        );
        let r = req(
            "POST",
            "/cache/checksums",
            Some(r#"{"block_ids":"abc","chunk_size":"x"}"#),
        );
        assert_eq!(r.status, 422);
        let d = r.json()["detail"].clone();
        assert_eq!(d[0]["type"], "list_type");
        assert_eq!(d[1]["type"], "int_parsing");
        assert_eq!(d[1]["loc"], json!(["body", "chunk_size"]));
        let r = req(
            "POST",
            "/cache/checksums",
            Some(r#"{"block_ids":[1,"x",2.5,null],"chunk_size":1}"#),
        );
        assert_eq!(r.status, 422);
        let d = r.json()["detail"].clone();
        assert_eq!(d[0]["loc"], json!(["body", "block_ids", 1]));
        assert_eq!(d[1]["type"], "int_from_float");
        assert_eq!(d[2]["type"], "int_type");

        let bad = |body: &str, status: u16, msg: &str| {
            let r = req("POST", "/cache/checksums", Some(body));
            assert_eq!(
                (r.status, r.json()),
                (status, json!({"detail": msg})),
                "{body}"
            );
        };
        bad("{}", 400, "block_ids is required");
        bad(
            r#"{"block_ids":[],"chunk_size":1}"#,
            400,
            "block_ids is required",
        );
        bad(r#"{"block_ids":[1]}"#, 400, "chunk_size must be positive");
        bad(
            r#"{"block_ids":[1],"chunk_size":-3}"#,
            400,
            "chunk_size must be positive",
        );
        bad(
            r#"{"block_ids":[1],"chunk_size":1,"instance_id":9223372036854775808}"#,
            404,
            "instance_id 9223372036854775808 not registered",
        );
    }

    #[test]
    fn quota_routes() {
        let r = req("PUT", "/quota/alice", Some(r#"{"limit_gb": 1.5}"#));
        assert_eq!(
            (r.status, r.json()),
            (
                200,
                json!({"cache_salt": "alice", "limit_gb": 1.5, "status": "ok"})
            )
        );
        // The sentinel maps to the empty salt on the way in and back on the way out.
        let r = req("PUT", "/quota/_default", Some(r#"{"limit_gb": 0}"#));
        assert_eq!(
            r.json(),
            json!({"cache_salt": "_default", "limit_gb": 0.0, "status": "ok"})
        );
        let r = req("GET", "/quota/_default", None);
        assert_eq!(r.json()["cache_salt"], "_default");
        let r = req("GET", "/quota/a%20b", None);
        assert_eq!(r.json()["cache_salt"], "a b");
        let r = req("DELETE", "/quota/bob", None);
        assert_eq!(
            r.json(),
            json!({"cache_salt": "bob", "status": "not_found"})
        );
        let r = req("GET", "/quota", None);
        assert_eq!(r.json()["users"]["_default"]["limit_gb"], 1.0);
        assert_eq!(r.json()["users"]["bob"]["current_usage_gb"], 0.5);
        assert!(r.json()["users"].get("").is_none());

        let lenient = |body: &str, want: f64| {
            let r = req("PUT", "/quota/x", Some(body));
            assert_eq!(
                (r.status, r.json()["limit_gb"].as_f64()),
                (200, Some(want)),
                "{body}"
            );
        };
        lenient(r#"{"limit_gb": "2.5"}"#, 2.5);
        lenient(r#"{"limit_gb": " 1_000 "}"#, 1000.0);
        lenient(r#"{"limit_gb": true}"#, 1.0);
        lenient(r#"{"limit_gb": 3, "other": NaN}"#, 3.0);

        let bad = |body: &str, msg: &str| {
            let r = req("PUT", "/quota/x", Some(body));
            assert_eq!((r.status, r.json()), (400, json!({"error": msg})), "{body}");
        };
        bad(r#"{"limit_gb": -1}"#, "limit_gb must be non-negative");
        bad(r#"{"limit_gb": "NaN"}"#, "limit_gb must be finite");
        bad(r#"{"limit_gb": NaN}"#, "limit_gb must be finite");
        bad(r#"{"limit_gb": "-inf"}"#, "limit_gb must be finite");
        bad(r#"{"limit_gb": Infinity}"#, "limit_gb must be finite");
        bad(r#"{"limit_gb": "lots"}"#, "limit_gb must be numeric");
        bad(r#"{"limit_gb": "1__0"}"#, "limit_gb must be numeric");
        bad(r#"{"limit_gb": null}"#, "limit_gb must be numeric");
        bad(r#"{"limit_gb": [1]}"#, "limit_gb must be numeric");
        bad(r#"{"limit": 1}"#, "body must be {'limit_gb': <float>}");
        bad("[1]", "body must be {'limit_gb': <float>}");
        bad("{", "invalid JSON body");
        bad("", "invalid JSON body");
    }

    #[test]
    fn unknown_paths_and_methods() {
        let r = req("GET", "/nope", None);
        assert_eq!((r.status, r.json()), (404, json!({"detail": "Not Found"})));
        let r = req("POST", "/run_script", Some("{}"));
        assert_eq!((r.status, r.json()), (404, json!({"detail": "Not Found"})));
        let r = req("GET", "/quota/a/b", None);
        assert_eq!(r.status, 404);

        let r = req("DELETE", "/status", None);
        assert_eq!(
            (r.status, r.json()),
            (405, json!({"detail": "Method Not Allowed"}))
        );
        assert_eq!(r.header("allow"), Some("GET, HEAD"));
        let r = req("POST", "/quota/x", Some("{}"));
        assert_eq!(r.status, 405);
        assert_eq!(r.header("allow"), Some("PUT, GET, HEAD, DELETE"));
        let r = req("GET", "/cache/clear", None);
        assert_eq!(r.status, 405);

        let r = req("GET", "/status/?x=1", None);
        assert_eq!(r.status, 307);
        assert_eq!(r.header("location"), Some("http://test.local/status?x=1"));

        let r = req("GET", "/cache/objects", None);
        assert_eq!(r.status, 501);
        assert!(r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("GET /cache/objects"));

        // Still serving after all of the above.
        assert_eq!(req("GET", "/healthcheck", None).status, 200);
    }

    #[test]
    fn oversized_bodies_are_refused() {
        let addr = server();
        let big = MAX_BODY_BYTES + 1;
        let raw = format!("PUT /quota/x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {big}\r\n\r\n{{\"limit_gb\":");
        let r = exchange(addr, raw.as_bytes());
        assert_eq!(r.status, 413);
        assert!(r.json()["detail"].as_str().unwrap().contains("larger than"));

        // Chunked, so only the running count can catch it.
        let mut raw = b"POST /cache/checksums HTTP/1.1\r\nHost: t\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        let chunk = vec![b' '; 64 * 1024];
        for _ in 0..(MAX_BODY_BYTES / chunk.len() + 1) {
            raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            raw.extend_from_slice(&chunk);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"0\r\n\r\n");
        let r = exchange(addr, &raw);
        assert_eq!(r.status, 413);

        assert_eq!(
            req("PUT", "/quota/x", Some(r#"{"limit_gb": 1}"#)).status,
            200
        );
    }

    #[test]
    fn slow_or_missing_front() {
        let t0 = std::time::Instant::now();
        let r = req("GET", "/quota/hang", None);
        assert_eq!(r.status, 504, "{r:?}");
        assert!(t0.elapsed() >= TEST_TIMEOUT && t0.elapsed() < Duration::from_secs(5));

        let gone = start_server(false);
        let r = req_at(gone, "GET", "/healthcheck", None);
        assert_eq!(
            (r.status, r.json()),
            (
                503,
                json!({"status": "unhealthy", "reason": "server is shutting down"})
            )
        );
        let r = req_at(gone, "GET", "/status", None);
        assert_eq!(r.status, 503);
        // Routes that need no front still answer.
        assert_eq!(req_at(gone, "GET", "/", None).status, 200);
    }

    #[test]
    fn slow_body_times_out() {
        let mut s = TcpStream::connect(server()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"PUT /quota/x HTTP/1.1\r\nHost: t\r\nContent-Length: 20\r\n\r\n{\"limit")
            .unwrap();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8(buf).unwrap();
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    }

    #[test]
    fn routing_table() {
        assert!(
            matches!(resolve(&Method::GET, "/quota/_default"), Resolved::Found(Endpoint::QuotaGet(s)) if s.is_empty())
        );
        assert!(
            matches!(resolve(&Method::PUT, "/quota/x"), Resolved::Found(Endpoint::QuotaSet(s)) if s == "x")
        );
        assert!(matches!(
            resolve(&Method::GET, "/quota/"),
            Resolved::NotFound
        ));
        assert!(matches!(
            resolve(&Method::POST, "/reconfigure/s3/l2/status"),
            Resolved::Found(Endpoint::NotImplemented)
        ));
        assert!(matches!(
            resolve(&Method::GET, "/run_script"),
            Resolved::NotFound
        ));
        assert!(matches!(
            resolve(&Method::HEAD, "/metrics"),
            Resolved::Found(Endpoint::Metrics)
        ));
        assert!(
            matches!(resolve(&Method::PATCH, "/metrics/reset"), Resolved::MethodNotAllowed(a) if a == vec![Method::POST])
        );
    }

    #[test]
    fn helpers() {
        assert_eq!(percent_decode("/quota/a%20b%2"), "/quota/a b%2");
        assert_eq!(percent_decode("/x%zz%C3%A9%ff"), "/x%zzé\u{fffd}");
        assert_eq!(python_float_str("1e3"), Some(1000.0));
        assert_eq!(python_float_str("_1"), None);
        assert_eq!(python_float_str("1_"), None);
        assert!(python_float_str("-Infinity").unwrap().is_infinite());
        assert_eq!(python_float_str(""), None);
        assert_eq!(
            quote_nonfinite_literals(r#"{"a":"NaN x","b":-Infinity}"#).as_deref(),
            Some(r#"{"a":"NaN x","b":"-Infinity"}"#)
        );
        assert_eq!(quote_nonfinite_literals(r#"{"a":"\"NaN"}"#), None);
    }
}
