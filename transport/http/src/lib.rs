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
use serde_json::{json, Value};

use kvshard_http_api::bodies::{parse_checksums, parse_clear, parse_limit_gb, Rejection};
use kvshard_http_api::routes::{
    percent_decode, redirect_location, resolve, Endpoint, Resolved, DEFAULT_SALT_SENTINEL,
};

use kvshard_io::http::{Conn, HttpServeConfig, HttpStats};
use kvshard_io::timeout::with_timeout;

use kvshard_control::control::ControlHandle;
use kvshard_control::metrics::{ProcessLimits, ProcessSample, PromText};
use kvshard_messages::control::{ControlBody, ControlRequest, ControlResponse};

/// Request bodies larger than this are refused with 413. The largest legitimate body
/// is a `/cache/checksums` block list: 1 MiB holds well over 100k block ids.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Default for [`HttpInfo::control_timeout`].
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// An early answer (boxed: responses are large).
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
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    let location = redirect_location(path, req.uri().query(), host)?;
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
            // A liveness probe: unhealthy only when the server cannot serve
            // from L1 (a shard stopped). A failing L2 tier makes `/status`
            // unhealthy, never this: restarting a server whose L1 serves
            // would lose the cache and fix nothing.
            let said_unhealthy = matches!(
                &r.body,
                ControlBody::Json(v) if v.get("serving") == Some(&Value::Bool(false))
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
        // A plain dict in 0.5.6: compact (only `/config` is indented).
        Endpoint::ConfigAdapters => control_response(
            call(ctx, ControlRequest::ConfigAdapters).await,
            JsonStyle::Compact,
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
                Err(r) => rejected(r),
            }
        }
        Endpoint::CacheChecksums => {
            let body = match read_body(req, ctx, conn).await {
                Ok(b) => b,
                Err(resp) => return *resp,
            };
            match parse_checksums(&body) {
                Ok(c) => {
                    let r = ControlRequest::Checksums {
                        instance_id: kvshard_messages::InstanceId(c.instance_id),
                        block_ids: c.block_ids,
                        chunk_size_blocks: c.chunk_size_blocks,
                        layerwise: c.layerwise,
                    };
                    control_response(call(ctx, r).await, JsonStyle::Compact)
                }
                Err(r) => rejected(r),
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
    rejected(Rejection::detail(status, msg))
}

fn rejected(r: Rejection) -> Response<Full<Bytes>> {
    json_response(r.status, &r.body)
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
                "instance_id": instance_id.0, "block_ids": block_ids,
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
        // 0.5.6's routes do not serve HEAD where they serve GET.
        for path in ["/", "/status", "/healthcheck", "/metrics"] {
            let head = req("HEAD", path, None);
            assert_eq!(head.status, 405, "{path}");
            assert_eq!(head.header("allow"), Some("GET"), "{path}");
            assert!(head.body.is_empty(), "{path}");
        }
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
        let r = req("GET", "/config/adapters", None);
        assert_eq!(r.status, 200);
        assert_eq!(r.body, r#"{"adapters":[]}"#, "compact like 0.5.6");
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
        // No block ids or no positive chunk size reach the front, which
        // refuses them once it has found the instance (as 0.5.6 does).
        let r = req(
            "POST",
            "/cache/checksums",
            Some(r#"{"block_ids":[],"chunk_size":-3}"#),
        );
        assert_eq!(
            (r.status, r.json()),
            (
                200,
                json!({"instance_id": 0, "block_ids": [], "chunk_size": 0, "layerwise": false})
            )
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
        // `Allow` names the first route at the path only, as Starlette answers.
        assert_eq!(r.header("allow"), Some("GET"));
        for (method, path, allow) in [
            ("POST", "/quota/x", "PUT"),
            ("POST", "/cache/objects", "GET"),
            ("OPTIONS", "/healthcheck", "GET"),
            ("GET", "/cache/clear", "POST"),
        ] {
            let r = req(method, path, Some("{}"));
            assert_eq!(
                (r.status, r.json()),
                (405, json!({"detail": "Method Not Allowed"})),
                "{method} {path}"
            );
            assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
        }

        for (target, location) in [
            ("/status/?x=1", "http://test.local/status?x=1"),
            ("/status//", "http://test.local/status"),
            ("/quota//", "http://test.local/quota"),
            // Built from the decoded path, as uvicorn + Starlette do.
            ("/status%2F", "http://test.local/status"),
            ("/quota/a%20b/", "http://test.local/quota/a%20b"),
        ] {
            let r = req("GET", target, None);
            assert_eq!(r.status, 307, "{target}");
            assert_eq!(r.header("location"), Some(location), "{target}");
        }

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
}
