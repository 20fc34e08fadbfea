//! End to end: a GPU worker's lmcache_driven registration (CUDA IPC
//! descriptors, the frames lmcache 0.5.6 itself encodes) against the real
//! binary. kvshard cannot map CUDA memory here, so the worker must hear it: the
//! registration is answered, refused with a reason that names the cause and the
//! engine_driven way in, the worker's PINGs are answered False (its client
//! degrades with a warning), its transfers fail at once, lookups for its model
//! report no GPU context, and everyone else keeps being served.

mod support;
use support::*;

/// The golden frames for GPU workers: `[uid, op, payloads...]`, hex.
fn golden() -> serde_json::Value {
    serde_json::from_str(include_str!("../wire/testdata/golden_cuda_register.json")).unwrap()
}

/// Sends golden request `name` (its op and payload frames, with a fresh uid)
/// and returns the reply.
fn send_golden(c: &mut Client, g: &serde_json::Value, name: &str) -> Reply {
    let frames: Vec<Vec<u8>> = g[name]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|f| {
            let s = f.as_str().unwrap();
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect();
    let op = frames[0].clone();
    let uid = c.send_raw(frames);
    let r = c.recv(uid);
    assert_eq!(r.op, op, "{name}: op echoed");
    r
}

const IID: i64 = 123456789;
const MODEL: &str = "Qwen/Qwen3-8B";

fn ping(c: &mut Client, iid: i64) -> bool {
    c.call(OP_PING, &[V::I(iid)])
        .expect("ping answers a bool")
        .boolean()
}

fn refused(srv: &Server) -> Vec<serde_json::Value> {
    srv.get_json("/status")["refused_gpu_instances"]
        .as_array()
        .expect("/status lists refused GPU instances")
        .clone()
}

fn text_has_transfer_errors(log: &std::path::Path) -> bool {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .any(|l| l.contains("ERROR") && l.contains("no lmcache_driven registration"))
}

fn counter(srv: &Server, name: &str) -> f64 {
    srv.metric(name, &[]).unwrap_or(0.0)
}

#[test]
fn a_cuda_registration_is_answered_refused_and_reported() {
    let dir = std::env::temp_dir().join(unique("gpu-workers"));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("server.log");
    let mut srv = Server::start_logged(&[], &log);
    let mut c = srv.client();
    let g = golden();
    let transfer_failed = Some(V::A(vec![V::Bin(vec![]), V::B(false)]));

    for (round, (name, tag)) in [
        ("register_kv_cache_cuda", "cuda"),
        ("register_kv_cache_cuda_raw", "cuda_raw"),
        ("register_kv_cache_cuda_vmm", "cuda_vmm"),
    ]
    .into_iter()
    .enumerate()
    {
        // Answered with 0.5.6's empty acknowledgement, as a success would be.
        let r = send_golden(&mut c, &g, name);
        assert_eq!(r.payload, None, "{name}: register acknowledged");
        // A heartbeat re-registration only refreshes the refused instance.
        assert_eq!(send_golden(&mut c, &g, name).payload, None);

        let list = refused(&srv);
        assert_eq!(list.len(), 1, "{list:?}");
        let e = &list[0];
        assert_eq!(e["instance_id"], IID);
        assert_eq!(e["model_name"], MODEL);
        assert_eq!(e["descriptor"], tag);
        let reason = e["reason"].as_str().unwrap();
        assert!(
            reason.contains("LMCACHE_MP_TRANSFER_MODE=engine_driven"),
            "{reason}"
        );
        assert!(
            reason.contains(&format!("/dev/shm/{}", srv.shm_name)),
            "{reason}"
        );
        // The cause depends on the host: no driver here; on a GPU host the
        // golden frames' GPU is not there (or the path is off, by default).
        assert!(
            reason.contains("no usable CUDA driver")
                || reason.contains("not visible to kvshard")
                || reason.contains("--cuda-transfer on"),
            "{reason}"
        );
        assert_eq!(
            counter(&srv, "kvshard_refused_cuda_registrations_total"),
            (round + 1) as f64
        );
        assert_eq!(counter(&srv, "kvshard_refused_gpu_instances"), 1.0);

        // Its PINGs say unhealthy; anonymous PINGs do not, and an instance
        // this server does not know hears unhealthy once (so that its client
        // registers again), then healthy.
        assert!(!ping(&mut c, IID));
        assert!(!ping(&mut c, IID + 1));
        assert!(ping(&mut c, IID + 1));
        assert_eq!(c.call(OP_PING, &[V::Nil]), Some(V::B(true)));

        // Its transfers fail at once, with 0.5.6's "no device work" reply.
        assert_eq!(send_golden(&mut c, &g, "store").payload, transfer_failed);
        assert_eq!(send_golden(&mut c, &g, "retrieve").payload, transfer_failed);

        // No layout was registered for its model: lookups miss early.
        let before = srv
            .metric(
                "lmcache_mp_lookup_early_exit_requests_total",
                &[("reason", "no_gpu_context")],
            )
            .unwrap_or(0.0);
        let toks = ed_tokens(7 + round as u32, 2 * ED_CHUNK);
        let key = ed_key(MODEL, None, &toks, 2, &format!("gpu-{round}"));
        assert_eq!(ed_lookup(&mut c, &key), 0);
        assert_eq!(
            srv.metric(
                "lmcache_mp_lookup_early_exit_requests_total",
                &[("reason", "no_gpu_context")]
            ),
            Some(before + 1.0)
        );

        // Unregistering forgets the refusal; the id is then unknown
        // (unhealthy once, then healthy).
        assert_eq!(c.call(OP_UNREGISTER_KV_CACHE, &[V::I(IID)]), None);
        assert!(refused(&srv).is_empty());
        assert_eq!(counter(&srv, "kvshard_refused_gpu_instances"), 0.0);
        assert!(!ping(&mut c, IID));
        assert!(ping(&mut c, IID));
    }

    // One error line per refusal, not one per re-registration or request.
    assert!(
        !text_has_transfer_errors(&log),
        "refused workers' transfers log no errors"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&format!("register_kv_cache from GPU instance {IID}")))
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines.iter().all(|l| l.contains("ERROR")), "{lines:?}");

    // A CPU worker on the same server is served throughout.
    assert_serving(&mut srv);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_refused_instance_registered_engine_driven_stays_healthy() {
    // One instance id may register both ways (0.5.6's two transfer modules):
    // the refused CUDA side must not make its working engine_driven side
    // report unhealthy.
    let mut srv = Server::start(&[]);
    let mut c = srv.client();
    let g = golden();
    assert_eq!(
        send_golden(&mut c, &g, "register_kv_cache_cuda").payload,
        None
    );
    assert!(!ping(&mut c, IID));
    ed_register(&mut c, IID, MODEL);
    assert!(ping(&mut c, IID));
    assert_eq!(refused(&srv).len(), 1);
    assert_serving(&mut srv);
}

#[test]
fn with_cuda_transfer_on_a_host_that_cannot_serve_it_still_refuses_clearly() {
    let srv = Server::start(&["--cuda-transfer", "on"]);
    let mut c = srv.client();
    let g = golden();
    assert_eq!(
        send_golden(&mut c, &g, "register_kv_cache_cuda_raw").payload,
        None
    );
    let list = refused(&srv);
    assert_eq!(list.len(), 1, "{list:?}");
    let reason = list[0]["reason"].as_str().unwrap();
    // No driver here; on a GPU host, the golden frames name a GPU it lacks.
    assert!(
        reason.contains("no usable CUDA driver") || reason.contains("not visible to kvshard"),
        "{reason}"
    );
    assert!(!ping(&mut c, IID));
    let failed = Some(V::A(vec![V::Bin(vec![]), V::B(false)]));
    assert_eq!(send_golden(&mut c, &g, "store").payload, failed);
    assert_eq!(send_golden(&mut c, &g, "retrieve").payload, failed);

    // A bad mode is refused at start.
    let err = Server::start_refused(&["--cuda-transfer", "maybe"]);
    assert!(err.contains("--cuda-transfer"), "{err}");
}
