//! End to end: the `resp` and `valkey` adapters behind the real binary, on
//! real `redis-server` processes on loopback. What a restarted kvshard (an
//! empty L1) finds in Redis hits with the bytes stored; an ACL user, TLS
//! with a private CA, a `TTL` per key and a server at `maxmemory` work as
//! configured, and when they are misconfigured the stores fail, counted,
//! while L1 serves. A Redis that stalls (SIGSTOP) or dies costs lookups a
//! request deadline at most, then misses at once behind the breaker or the
//! tier's gate, and kvshard uses it again by itself once it is back.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvshard_resp::Reply;
use support::*;

/// Short deadlines and a short breaker cooldown, for the fault tests.
const FAST_FAILURE: &str =
    r#","request_timeout":0.5,"connection_timeout":0.5,"breaker_initial_cooldown_s":0.5"#;

/// The most a lookup and retrieve may take once Redis is known to be down.
const PROMPT: Duration = Duration::from_secs(1);

fn resp_spec(port: u16, extra: &str) -> String {
    format!(r#"{{"type":"resp","host":"127.0.0.1","port":{port},"num_workers":2{extra}}}"#)
}

fn valkey_spec(port: u16, extra: &str) -> String {
    format!(r#"{{"type":"valkey","startup_nodes":"127.0.0.1:{port}","num_workers":2{extra}}}"#)
}

// ------------------------------------------------------------ redis side

type Auth<'a> = RedisAuth<'a>;

fn text(port: u16, auth: Auth<'_>, args: &[&str]) -> Reply {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    redis_call(port, auth, &args)
}

/// The keys matching `pattern`.
fn keys(port: u16, auth: Auth<'_>, pattern: &str) -> Vec<String> {
    match text(port, auth, &["KEYS", pattern]) {
        Reply::Array(items) => items
            .into_iter()
            .map(|k| match k {
                Reply::Bulk(b) => String::from_utf8(b).expect("a UTF-8 key"),
                other => panic!("KEYS answered {other:?}"),
            })
            .collect(),
        other => panic!("KEYS answered {other:?}"),
    }
}

fn integer(port: u16, auth: Auth<'_>, args: &[&str]) -> i64 {
    match text(port, auth, args) {
        Reply::Integer(n) => n,
        other => panic!("{args:?} answered {other:?}"),
    }
}

/// A field of `INFO <section>`.
fn info_field(port: u16, section: &str, field: &str) -> i64 {
    let Reply::Bulk(info) = text(port, None, &["INFO", section]) else {
        panic!("INFO {section}: not a bulk reply");
    };
    String::from_utf8_lossy(&info)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("INFO {section} has no {field}"))
        .trim()
        .parse()
        .unwrap()
}

/// Every key matching `pattern` holds the bytes of one of `chunks`, whole.
fn assert_values_are(port: u16, auth: Auth<'_>, pattern: &str, chunks: &[Vec<u8>]) {
    for k in keys(port, auth, pattern) {
        match redis_call(port, auth, &[b"GET", k.as_bytes()]) {
            Reply::Bulk(v) => assert!(chunks.contains(&v), "{k} holds bytes never stored"),
            other => panic!("GET {k}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------- kvshard side

/// A family of `/metrics` summed over its series (the tier is `resp#1` or
/// `valkey#1`); 0 when not exposed.
fn total(srv: &Server, name: &str) -> f64 {
    srv.scrape()
        .iter()
        .filter(|x| x.name == name)
        .map(|x| x.value)
        .sum()
}

/// `kvshard_resp_requests_total` of `outcome`, of every command or of `op`.
fn requests(srv: &Server, op: Option<&str>, outcome: &str) -> f64 {
    let has = |x: &PromSample, k: &str, v: &str| x.labels.iter().any(|(a, b)| a == k && b == v);
    srv.scrape()
        .iter()
        .filter(|x| {
            x.name == "kvshard_resp_requests_total"
                && has(x, "outcome", outcome)
                && op.is_none_or(|op| has(x, "op", op))
        })
        .map(|x| x.value)
        .sum()
}

fn adapter_status(srv: &Server) -> serde_json::Value {
    srv.get_json("/status")["storage_manager"]["l2_adapters"][0].clone()
}

/// The client's breaker is open or the tier's gate is closed, on a shard.
fn breaker_open(srv: &Server) -> bool {
    adapter_status(srv)["connection_disabled"] == true
}

/// Each shard's adapter status.
fn shard_adapters(srv: &Server) -> Vec<serde_json::Value> {
    adapter_status(srv)["shards"]
        .as_array()
        .expect("shards")
        .iter()
        .map(|s| s["adapter"].clone())
        .collect()
}

/// A count of the adapters' status, summed over shards.
fn adapter_count(srv: &Server, field: &str) -> u64 {
    shard_adapters(srv)
        .iter()
        .map(|a| a[field].as_u64().unwrap_or(0))
        .sum()
}

/// The last connect error of every node of every shard.
fn connect_errors(srv: &Server) -> Vec<String> {
    shard_adapters(srv)
        .iter()
        .flat_map(|a| a["client"]["nodes"].as_array().cloned().unwrap_or_default())
        .filter_map(|n| n["last_connect_error"].as_str().map(str::to_owned))
        .collect()
}

/// Stores the first `n` chunks of `toks` through a server on `spec`, waits
/// until Redis holds `n` keys of model "m" and the stores settled: the
/// bytes stored.
fn store_into_redis(
    spec: &str,
    port: u16,
    auth: Auth<'_>,
    toks: &[u32],
    n: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let srv = Server::start(&["--l2-adapter", spec]);
    let stored = ed_store_chunks(&srv, 1, toks, n, seed);
    wait_until("the keys in redis", || {
        keys(port, auth, "m@*").len() == n && srv.stores_settled()
    });
    assert_eq!(total(&srv, "kvshard_l2_store_failed_objects_total"), 0.0);
    assert_eq!(adapter_count(&srv, "stored"), n as u64);
    stored
}

/// Lookups of `toks` (in Redis only, or nowhere) while Redis does not
/// answer, for `span`: each is a miss; (how long each took, whether
/// `/status` showed the tier disabled after one).
fn lookups_while_down(
    srv: &Server,
    toks: &[u32],
    n: usize,
    span: Duration,
) -> (Vec<Duration>, bool) {
    let t0 = Instant::now();
    let mut took = Vec::new();
    let mut disabled = false;
    while t0.elapsed() < span {
        let rid = format!("down-{}", took.len());
        let t = Instant::now();
        let (hits, back) = ed_lookup_retrieve(srv, 2, toks, n, &rid);
        took.push(t.elapsed());
        assert_eq!(
            (hits, back.len()),
            (0, 0),
            "{rid}: a hit from a Redis that is down"
        );
        disabled |= breaker_open(srv);
        std::thread::sleep(Duration::from_millis(100));
    }
    (took, disabled)
}

/// The slowest of `took` after the first two.
fn slowest_after_two(took: &[Duration]) -> Duration {
    took.iter().skip(2).max().copied().unwrap_or_default()
}

// ------------------------------------------------------------ the tests

#[test]
fn restart_with_an_empty_l1_hits_from_redis() {
    let redis = RedisServer::start(&[]);
    let spec = resp_spec(redis.port, "");
    let toks = ed_tokens(101, 4 * ED_CHUNK);
    let stored = store_into_redis(&spec, redis.port, None, &toks, 4, 1);
    // 0.5.6's layout: the key is the object's name, the value its bytes;
    // the resp type sets no expiry.
    assert_values_are(redis.port, None, "m@*", &stored);
    for k in keys(redis.port, None, "m@*") {
        assert_eq!(
            k.split('@').count(),
            4,
            "{k}: <model>@<rank>@<group>@<hash>"
        );
        assert_eq!(integer(redis.port, None, &["TTL", &k]), -1, "{k} expires");
    }

    // A new server: L1 is empty, every chunk comes from Redis.
    let mut srv = Server::start(&["--l2-adapter", &spec]);
    assert_eq!(srv.l1_count("total_object_count"), 0);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 4, "from-redis");
    assert_eq!(hits, 4);
    assert!(
        back == stored,
        "bytes from Redis differ from the stored ones"
    );
    assert!(requests(&srv, None, "ok") > 0.0);
    assert!(requests(&srv, Some("get"), "ok") >= 4.0);
    assert!(total(&srv, "kvshard_resp_requests_total") > 0.0);
    assert!(total(&srv, "kvshard_resp_connects_total") >= 1.0);
    assert!(total(&srv, "kvshard_resp_received_bytes_total") >= (4 * ED_CHUNK_BYTES) as f64);
    assert_eq!(total(&srv, "kvshard_resp_timeouts_total"), 0.0);
    assert_eq!(adapter_count(&srv, "loaded"), 4);
    let st = adapter_status(&srv);
    assert_eq!(st["nodes"][0], format!("127.0.0.1:{}", redis.port), "{st}");
    assert_eq!(st["connection_disabled"], false, "{st}");
    assert_eq!(st["is_healthy"], true, "{st}");
    // A miss is a miss: chunks nobody stored.
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &ed_tokens(102, 2 * ED_CHUNK), 2, "unknown");
    assert_eq!(hits, 0);
    assert_serving(&mut srv);
}

#[test]
fn acl_user_auth() {
    const USER: &str = "kv";
    const PASSWORD: &str = "secret";
    const WRONG: &str = "wrong-password-4711";
    let redis = RedisServer::start(&[]);
    let port = redis.port;
    let ok = |r: Reply| assert_eq!(r, Reply::Simple(b"OK".to_vec()));
    ok(text(
        port,
        None,
        &["ACL", "SETUSER", USER, "on", ">secret", "~*", "+@all"],
    ));
    ok(text(port, None, &["ACL", "SETUSER", "default", "off"]));
    let auth = Some((USER, PASSWORD));
    match text(port, None, &["PING"]) {
        Reply::Error(e) => assert!(e.starts_with(b"NOAUTH"), "{}", String::from_utf8_lossy(&e)),
        other => panic!("an unauthenticated PING answered {other:?}"),
    }

    // The ACL user: stores land, a restarted server hits.
    let spec = resp_spec(
        port,
        &format!(r#","username":"{USER}","password":"{PASSWORD}""#),
    );
    let toks = ed_tokens(201, 3 * ED_CHUNK);
    let stored = store_into_redis(&spec, port, auth, &toks, 3, 2);
    assert_values_are(port, auth, "m@*", &stored);
    let log = log_path("kvshard-resp-acl");
    let mut srv = Server::start_logged(&["--l2-adapter", &spec], &log);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "acl");
    assert_eq!(hits, 3);
    assert!(back == stored);
    assert_eq!(requests(&srv, None, "refused"), 0.0);
    for path in ["/status", "/config", "/config/adapters", "/metrics"] {
        let (st, body) = srv.http("GET", path, None);
        assert_eq!(st, 200, "{path}: {body}");
        assert!(
            !body.contains(PASSWORD),
            "{path} shows the password: {body}"
        );
    }
    assert_serving(&mut srv);
    drop(srv);

    // A wrong password: AUTH is refused, every store fails and is counted,
    // L1 serves, and nothing shows the password.
    let wrong = resp_spec(
        port,
        &format!(r#","username":"{USER}","password":"{WRONG}""#),
    );
    let wrong_log = log_path("kvshard-resp-wrongpass");
    let mut srv = Server::start_logged(&["--l2-adapter", &wrong], &wrong_log);
    let other = ed_tokens(202, 3 * ED_CHUNK);
    let in_l1 = ed_store_chunks(&srv, 1, &other, 3, 3);
    wait_until("the refused stores to settle", || srv.stores_settled());
    assert!(total(&srv, "kvshard_l2_store_failed_objects_total") >= 3.0);
    assert!(requests(&srv, Some("set"), "refused") >= 1.0);
    assert_eq!(adapter_count(&srv, "stored"), 0);
    assert_eq!(keys(port, auth, "m@*").len(), 3, "a refused store landed");
    let errors = connect_errors(&srv);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("AUTH") && e.contains("WRONGPASS")),
        "{errors:?}"
    );
    // A configuration problem, not a dead server: the breaker stays shut.
    assert_eq!(total(&srv, "kvshard_resp_breaker_trips_total"), 0.0);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &other, 3, "l1");
    assert_eq!(hits, 3);
    assert!(back == in_l1, "L1 bytes changed under refused stores");
    // What is only in Redis is a miss now, promptly.
    let t0 = Instant::now();
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &toks, 3, "refused");
    assert_eq!(hits, 0);
    assert!(t0.elapsed() < PROMPT * 2, "{:?}", t0.elapsed());
    assert_serving(&mut srv);
    for path in ["/status", "/config", "/config/adapters", "/metrics"] {
        let (st, body) = srv.http("GET", path, None);
        assert_eq!(st, 200, "{path}: {body}");
        assert!(!body.contains(WRONG), "{path} shows the password: {body}");
    }
    drop(srv);
    // The log names the refusal, never the password.
    let text = std::fs::read_to_string(&wrong_log).unwrap();
    assert!(text.contains("AUTH refused: WRONGPASS"), "{text}");
    for (log, pw) in [(&log, PASSWORD), (&wrong_log, WRONG)] {
        let text = std::fs::read_to_string(log).unwrap();
        assert!(!text.contains(pw), "the log shows the password: {text}");
        let _ = std::fs::remove_file(log);
    }
}

/// A CA and a certificate it signed for 127.0.0.1, as PEM files.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(tag: &str) -> Pki {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let dir = std::env::temp_dir().join(unique(&format!("kvshard-resp-{tag}")));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("kvshard test CA {tag}"));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("the CA certificate");
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().expect("a server key");
        let mut leaf =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        leaf.use_authority_key_identifier_extension = true;
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = leaf
            .signed_by(&key, &issuer)
            .expect("the server certificate");
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
        std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Fails the test when this `redis-server` has no TLS: one started with a
/// TLS port and missing certificate files exits at once, complaining of the
/// files when it has TLS and of the directive when it has none.
fn assert_redis_has_tls() {
    let mut child = std::process::Command::new(redis_bin_dir().join("redis-server"))
        .args([
            "--port",
            "0",
            "--tls-port",
            &free_port().to_string(),
            "--tls-cert-file",
            "/nonexistent/cert.pem",
            "--tls-key-file",
            "/nonexistent/key.pem",
            "--tls-ca-cert-file",
            "/nonexistent/ca.pem",
            "--save",
            "",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start redis-server");
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !said.contains("Bad directive") && !said.contains("not built with TLS"),
        "redis-server refuses --tls-port (built without TLS?): {said}"
    );
}

/// A Redis that speaks TLS on `tls_port` with `pki`'s certificate (and
/// plain RESP on its own port, for the test's checks).
fn tls_redis(pki: &Pki, tls_port: u16) -> RedisServer {
    assert_redis_has_tls();
    RedisServer::start(&[
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &pki.path("server.pem"),
        "--tls-key-file",
        &pki.path("server.key"),
        "--tls-ca-cert-file",
        &pki.path("ca.pem"),
        "--tls-auth-clients",
        "no",
    ])
}

#[test]
fn tls() {
    let pki = Pki::new("tls");
    let tls_port = free_port();
    let redis = tls_redis(&pki, tls_port);
    let spec = resp_spec(
        tls_port,
        &format!(
            r#","tls_enable":true,"tls_ca_bundle":"{}""#,
            pki.path("ca.pem")
        ),
    );
    let toks = ed_tokens(301, 3 * ED_CHUNK);
    let stored = store_into_redis(&spec, redis.port, None, &toks, 3, 4);
    assert_values_are(redis.port, None, "m@*", &stored);
    let srv = Server::start(&["--l2-adapter", &spec]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "tls");
    assert_eq!(hits, 3);
    assert!(back == stored);
    assert!(shard_adapters(&srv)
        .iter()
        .all(|a| a["client"]["tls"] == true));
    drop(srv);

    // Without the CA bundle (the trust store is another CA's): the
    // certificate is refused, stores fail, L1 serves.
    let other = Pki::new("other");
    let plain = resp_spec(tls_port, r#","tls_enable":true"#);
    let log = log_path("kvshard-resp-untrusted");
    let mut srv = Server::start_logged_env(
        &["--l2-adapter", &plain],
        &log,
        &[("SSL_CERT_FILE", &other.path("ca.pem"))],
    );
    let toks2 = ed_tokens(302, 3 * ED_CHUNK);
    let in_l1 = ed_store_chunks(&srv, 1, &toks2, 3, 5);
    wait_until("the refused stores to settle", || srv.stores_settled());
    assert!(total(&srv, "kvshard_l2_store_failed_objects_total") >= 3.0);
    assert!(requests(&srv, Some("set"), "refused") >= 1.0);
    let errors = connect_errors(&srv);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("TLS") && e.to_ascii_lowercase().contains("certificate")),
        "{errors:?}"
    );
    assert_eq!(
        keys(redis.port, None, "m@*").len(),
        3,
        "a refused store landed"
    );
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks2, 3, "l1");
    assert_eq!(hits, 3);
    assert!(back == in_l1);
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &toks, 3, "untrusted");
    assert_eq!(hits, 0, "a hit through a refused certificate");
    assert_serving(&mut srv);
    drop(srv);
    let _ = std::fs::remove_file(&log);
}

/// Hidden size of the big chunks: 4 MiB objects, twice Redis's maxmemory.
const BIG_HIDDEN: usize = 32 * 1024;

#[test]
fn maxmemory_refusal_is_counted() {
    let redis = RedisServer::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    let spec = resp_spec(redis.port, "");
    let mut srv = Server::start(&["--l2-adapter", &spec]);
    let toks = ed_tokens(401, 2 * ED_CHUNK);
    let big = ed_store_chunks_of(&srv, 1, "big", BIG_HIDDEN, &toks, 2, 6);
    wait_until("the refused stores to settle", || srv.stores_settled());
    assert!(total(&srv, "kvshard_resp_oom_rejected_total") >= 2.0);
    assert!(total(&srv, "kvshard_l2_store_failed_objects_total") >= 2.0);
    assert!(requests(&srv, Some("set"), "error") >= 2.0);
    assert!(keys(redis.port, None, "big@*").is_empty());
    assert_eq!(
        adapter_count(&srv, "oom_rejected"),
        adapter_count(&srv, "store_failed")
    );
    // Refused once, not retried: the counts stay where they are.
    let oom = total(&srv, "kvshard_resp_oom_rejected_total");
    let sets = requests(&srv, Some("set"), "error");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(total(&srv, "kvshard_resp_oom_rejected_total"), oom);
    assert_eq!(requests(&srv, Some("set"), "error"), sets);
    // An error reply is an answer: no breaker, no timeout, the connection
    // stays in step and a small store lands on it.
    assert_eq!(total(&srv, "kvshard_resp_breaker_trips_total"), 0.0);
    assert_eq!(total(&srv, "kvshard_resp_timeouts_total"), 0.0);
    let small = ed_tokens(402, 2 * ED_CHUNK);
    let fits = ed_store_chunks(&srv, 3, &small, 2, 7);
    wait_until("the small chunks in redis", || {
        keys(redis.port, None, "m@*").len() == 2 && srv.stores_settled()
    });
    assert_values_are(redis.port, None, "m@*", &fits);
    // L1 kept the big chunks, byte for byte.
    let (hits, back) = ed_lookup_retrieve_of(&srv, 2, "big", BIG_HIDDEN, &toks, 2, "big-l1");
    assert_eq!(hits, 2);
    assert!(back == big, "L1 bytes changed under refused stores");
    assert_serving(&mut srv);
}

#[test]
fn ttl_seconds_expires_keys() {
    let redis = RedisServer::start(&[]);
    let spec = valkey_spec(redis.port, r#","ttl_seconds":1,"key_prefix":"kv""#);
    let toks = ed_tokens(501, 3 * ED_CHUNK);
    let expired_before = info_field(redis.port, "stats", "expired_keys");
    {
        let srv = Server::start(&["--l2-adapter", &spec]);
        ed_store_chunks(&srv, 1, &toks, 3, 8);
        wait_until("the stores to settle", || {
            srv.stores_settled() && adapter_count(&srv, "stored") == 3
        });
        assert_eq!(total(&srv, "kvshard_l2_store_failed_objects_total"), 0.0);
        // Whatever is still there expires within a second.
        for k in keys(redis.port, None, "*") {
            assert!(k.starts_with("kv@m@"), "{k}: not under the key prefix");
            let ttl = integer(redis.port, None, &["TTL", &k]);
            assert!((-2..=1).contains(&ttl) && ttl != -1, "{k}: TTL {ttl}");
        }
    }
    // Redis expires them: three keys that had a TTL are gone.
    wait_until_within(
        "the keys to expire",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            integer(redis.port, None, &["DBSIZE"]) == 0
                && info_field(redis.port, "stats", "expired_keys") >= expired_before + 3
        },
    );
    // A new server finds nothing.
    let srv = Server::start(&["--l2-adapter", &spec]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "expired");
    assert_eq!((hits, back.len()), (0, 0));
    assert!(
        requests(&srv, None, "ok") >= 1.0,
        "the lookup did not ask Redis"
    );
}

#[test]
fn a_stalled_server_degrades_to_misses_and_recovers() {
    let redis = RedisServer::start(&[]);
    // The default cooldowns (5 s, doubling to 300 s): recovery does not
    // wait for them, a request probes the open breaker once a second.
    let spec = resp_spec(redis.port, FAST_FAILURE);
    let toks = ed_tokens(601, 3 * ED_CHUNK);
    let stored = store_into_redis(&spec, redis.port, None, &toks, 3, 9);
    let mut srv = Server::start(&["--l2-adapter", &spec]);
    // Connected and answering: a hit (the loaded objects are freed once
    // retrieved, so later lookups ask Redis again).
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "before");
    assert_eq!(hits, 3);
    assert!(back == stored);
    wait_until("loaded objects freed", || {
        srv.l1_count("total_object_count") == 0
    });

    // Stopped: connections open (the kernel accepts) and nothing answers.
    redis.signal(libc::SIGSTOP);
    let stopped_at = Instant::now();
    let (mut took, mut disabled) = lookups_while_down(&srv, &toks, 3, Duration::from_secs(4));
    assert!(total(&srv, "kvshard_resp_timeouts_total") >= 1.0);
    assert!(total(&srv, "kvshard_resp_breaker_trips_total") >= 1.0);
    assert!(requests(&srv, Some("exists"), "timeout") >= 1.0);
    assert!(requests(&srv, Some("exists"), "unavailable") >= 1.0);
    assert!(total(&srv, "kvshard_l2_lookup_timeouts_total") >= 1.0);
    // L1 serves meanwhile.
    let l1 = ed_tokens(602, 2 * ED_CHUNK);
    let kept = ed_store_chunks(&srv, 1, &l1, 2, 10);
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &l1, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == kept);
    assert_serving(&mut srv);
    // Lookups go on until the server has been stopped for 10 s.
    let left = Duration::from_secs(10).saturating_sub(stopped_at.elapsed());
    let (more, seen) = lookups_while_down(&srv, &toks, 3, left);
    took.extend(more);
    disabled |= seen;
    eprintln!("lookups while stopped: {took:?}");
    assert!(took.len() >= 10, "{took:?}");
    assert!(took[0] < PROMPT * 3, "the first lookup took {:?}", took[0]);
    assert!(slowest_after_two(&took) < PROMPT, "{took:?}");
    assert!(disabled, "/status never showed the tier disabled");

    // Going again: lookups hit with the stored bytes, by themselves.
    redis.signal(libc::SIGCONT);
    let back_at = Instant::now();
    let mut attempt = 0;
    wait_until("a hit after SIGCONT", || {
        attempt += 1;
        let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, &format!("after-{attempt}"));
        if hits > 0 {
            assert!(
                back == stored[..hits as usize],
                "wrong bytes after the stall"
            );
        }
        hits == 3
    });
    let recovered = back_at.elapsed();
    eprintln!("hits again {recovered:?} after SIGCONT");
    assert!(recovered < Duration::from_secs(5), "{recovered:?}");
    wait_until("the tier enabled again", || !breaker_open(&srv));
    assert_serving(&mut srv);
}

#[test]
fn a_killed_server_comes_back() {
    let mut redis = RedisServer::start(&[]);
    let spec = resp_spec(redis.port, FAST_FAILURE);
    let toks = ed_tokens(701, 3 * ED_CHUNK);
    let stored = store_into_redis(&spec, redis.port, None, &toks, 3, 11);
    let mut srv = Server::start(&["--l2-adapter", &spec]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 3, "before");
    assert_eq!(hits, 3);
    assert!(back == stored);

    // Dead: connections break and reconnects are refused.
    redis.kill();
    let (took, disabled) = lookups_while_down(&srv, &toks, 3, Duration::from_secs(3));
    eprintln!("lookups while dead: {took:?}");
    assert!(slowest_after_two(&took) < PROMPT, "{took:?}");
    assert!(took.iter().all(|t| *t < PROMPT * 3), "{took:?}");
    // Three refused connects in a row open the breaker (for its cooldown:
    // the connect backoff makes later failures fast by itself).
    assert!(disabled, "/status never showed the breaker open");
    assert!(total(&srv, "kvshard_resp_connect_failures_total") >= 3.0);
    assert!(total(&srv, "kvshard_resp_breaker_trips_total") >= 1.0);
    assert!(requests(&srv, Some("exists"), "unavailable") >= 3.0);
    // L1 serves; stores to L2 fail.
    let l1 = ed_tokens(702, 2 * ED_CHUNK);
    let kept = ed_store_chunks(&srv, 1, &l1, 2, 12);
    wait_until("the failed stores to settle", || srv.stores_settled());
    assert!(total(&srv, "kvshard_l2_store_failed_objects_total") >= 2.0);
    let (hits, back) = ed_lookup_retrieve(&srv, 3, &l1, 2, "l1");
    assert_eq!(hits, 2);
    assert!(back == kept);
    assert_serving(&mut srv);

    // Back, empty: what was stored before is a miss; new stores land.
    redis.restart();
    let back_at = Instant::now();
    let mut attempt = 0u32;
    let mut landed = None;
    wait_until("a store to land in the restarted redis", || {
        attempt += 1;
        let t = ed_tokens(710 + attempt, 2 * ED_CHUNK);
        let bytes = ed_store_chunks(&srv, 1, &t, 2, 20 + attempt as u64);
        wait_until("stores to settle", || srv.stores_settled());
        if keys(redis.port, None, "m@*").len() == 2 {
            landed = Some((t, bytes));
            return true;
        }
        // Stored while the client was still backing off: one of the two
        // may have landed. Cleared; the next attempt stores new chunks.
        for k in keys(redis.port, None, "m@*") {
            text(redis.port, None, &["DEL", &k]);
        }
        std::thread::sleep(Duration::from_millis(200));
        false
    });
    eprintln!(
        "stores land again {:?} after the restart",
        back_at.elapsed()
    );
    let (new_toks, new_bytes) = landed.unwrap();
    assert_values_are(redis.port, None, "m@*", &new_bytes);
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &toks, 3, "lost");
    assert_eq!(hits, 0, "a hit on what the restarted redis never had");
    drop(srv);

    let srv = Server::start(&["--l2-adapter", &spec]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &new_toks, 2, "after");
    assert_eq!(hits, 2);
    assert!(back == new_bytes);
}

/// Slots a `CLUSTER NODES` line lists.
fn slot_count(line: &str) -> u32 {
    line.split(' ')
        .skip(8)
        .filter_map(|r| {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            Some(b.parse::<u32>().ok()? - a.parse::<u32>().ok()? + 1)
        })
        .sum()
}

/// The `myself` line of a node's `CLUSTER NODES`.
fn myself(port: u16) -> String {
    redis_command(port, &["CLUSTER", "NODES"])
        .lines()
        .find(|l| l.contains("myself"))
        .expect("a myself line")
        .to_owned()
}

fn is_master(port: u16) -> bool {
    redis_command(port, &["ROLE"]).starts_with("master")
}

/// Lookups and retrieves of `toks` from `srv` until `job` (on a thread)
/// ends; every hit must be the stored bytes: the rounds, and those that
/// did not hit every chunk.
fn retrieves_during(
    srv: &Server,
    toks: &[u32],
    stored: &[Vec<u8>],
    label: &str,
    job: impl FnOnce() + Send + 'static,
) -> (u32, u32) {
    let worker = std::thread::spawn(job);
    let (mut rounds, mut short) = (0, 0);
    while !worker.is_finished() || rounds == 0 {
        let (hits, back) =
            ed_lookup_retrieve(srv, 2, toks, stored.len(), &format!("{label}-{rounds}"));
        assert!(
            back[..] == stored[..hits as usize],
            "{label}: round {rounds} retrieved other bytes"
        );
        if (hits as usize) < stored.len() {
            short += 1;
        }
        rounds += 1;
    }
    worker.join().expect("the cluster job failed");
    (rounds, short)
}

#[test]
fn a_cluster_resharded_and_failed_over_during_a_run_keeps_every_chunk() {
    let cluster = RedisCluster::start(3, 1);
    let spec = format!(
        r#"{{"type":"valkey","startup_nodes":"{}","cluster_mode":true,"num_workers":2,"key_prefix":"e2e"}}"#,
        cluster.startup_nodes()
    );
    let n = 24;
    let toks = ed_tokens(901, n * ED_CHUNK);
    let srv = Server::start(&["--l2-adapter", &spec]);
    let stored = ed_store_chunks(&srv, 1, &toks, n, 11);
    let keys_in = |c: &RedisCluster| -> i64 {
        c.nodes
            .iter()
            .filter(|node| is_master(node.port))
            .map(|node| integer(node.port, None, &["DBSIZE"]))
            .sum()
    };
    wait_until("the chunks in the cluster", || {
        keys_in(&cluster) == n as i64 && srv.stores_settled()
    });
    drop(srv);
    // An empty L1: every hit comes from the cluster.
    let srv = Server::start(&["--l2-adapter", &spec]);

    // The master holding the most chunks gives all its slots to another.
    let masters: Vec<u16> = cluster
        .nodes
        .iter()
        .map(|node| node.port)
        .filter(|p| is_master(*p))
        .collect();
    let from = *masters
        .iter()
        .max_by_key(|p| integer(**p, None, &["DBSIZE"]))
        .unwrap();
    let to = *masters.iter().find(|p| **p != from).unwrap();
    let moving = integer(from, None, &["DBSIZE"]);
    assert!(moving > 0);
    let slots = slot_count(&myself(from)).to_string();
    let (from_id, to_id) = (
        redis_command(from, &["CLUSTER", "MYID"]),
        redis_command(to, &["CLUSTER", "MYID"]),
    );
    let cli = redis_bin_dir().join("redis-cli");
    let (rounds, short) = retrieves_during(&srv, &toks, &stored, "reshard", move || {
        let out = std::process::Command::new(cli)
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &slots, "--cluster-yes"])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "reshard: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    });
    assert_eq!(
        integer(from, None, &["DBSIZE"]),
        0,
        "the reshard left chunks behind"
    );
    assert_eq!(
        short, 0,
        "{short} of {rounds} rounds missed chunks while {moving} moved"
    );
    assert!(total(&srv, "kvshard_resp_cluster_moved_total") > 0.0);
    cluster.wait_ok();

    // The master now holding them fails over to its replica.
    let to_id = redis_command(to, &["CLUSTER", "MYID"]);
    let replica = cluster
        .nodes
        .iter()
        .map(|node| node.port)
        .find(|p| myself(*p).contains(&format!("slave {to_id}")))
        .expect("a replica of the master");
    let (rounds, short) = retrieves_during(&srv, &toks, &stored, "failover", move || {
        // A manual failover gives up quietly when the replica does not
        // catch up within 5 s (a busy machine): ask again, as an operator
        // would.
        let t0 = Instant::now();
        let mut asked: Option<Instant> = None;
        while !is_master(replica) {
            if asked.is_none_or(|at| at.elapsed() > Duration::from_secs(8)) {
                assert_eq!(redis_command(replica, &["CLUSTER", "FAILOVER"]), "OK");
                asked = Some(Instant::now());
            }
            assert!(t0.elapsed() < Duration::from_secs(45), "no failover");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
    });
    eprintln!("failover: {short} of {rounds} rounds missed chunks");
    cluster.wait_ok();
    // Every acknowledged chunk is there, byte for byte.
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, n, "after");
    assert_eq!(hits as usize, n);
    assert!(back == stored);
}

#[test]
fn database_id_selects_the_database() {
    let redis = RedisServer::start(&[]);
    let spec = valkey_spec(redis.port, r#","database_id":5"#);
    let toks = ed_tokens(951, 2 * ED_CHUNK);
    let srv = Server::start(&["--l2-adapter", &spec]);
    let stored = ed_store_chunks(&srv, 1, &toks, 2, 21);
    let keyspace = || redis_command(redis.port, &["INFO", "keyspace"]);
    wait_until("the keys in database 5", || {
        keyspace().contains("db5:keys=2,") && srv.stores_settled()
    });
    assert!(!keyspace().contains("db0:"), "{}", keyspace());
    drop(srv);
    let srv = Server::start(&["--l2-adapter", &spec]);
    let (hits, back) = ed_lookup_retrieve(&srv, 2, &toks, 2, "db5");
    assert_eq!(hits, 2);
    assert!(back == stored);
    // The same keys are not in another database.
    let other = valkey_spec(redis.port, r#","database_id":6"#);
    let srv = Server::start(&["--l2-adapter", &other]);
    let (hits, _) = ed_lookup_retrieve(&srv, 2, &toks, 2, "db6");
    assert_eq!(hits, 0);
}
