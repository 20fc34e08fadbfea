//! tools/deploy: the planner's plans for the recorded fixtures match the expected
//! ones, its plan for this machine starts a kvshard that serves and stops cleanly
//! on SIGTERM, every flag it emits is one `kvshard server` has, `--apply` is
//! refused where it makes no sense, and the systemd unit and shell scripts lint
//! clean where systemd-analyze and shellcheck are installed.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const FIXTURES: [&str; 2] = ["two-socket-8gpu", "one-socket-no-numa"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/deploy")
}

fn fixture(name: &str) -> PathBuf {
    deploy_dir().join("fixtures").join(name)
}

fn fixture_args(name: &str) -> Vec<String> {
    let path = deploy_dir().join("fixtures").join(format!("{name}.args"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Runs the planner with `args`.
fn planner<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new("python3")
        .arg(deploy_dir().join("kvshard-plan"))
        .args(args)
        .output()
        .expect("python3 runs tools/deploy/kvshard-plan")
}

fn stdout_ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn fixture_plan(name: &str, format: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "--root".to_string(),
        fixture(name).display().to_string(),
        "--format".to_string(),
        format.to_string(),
    ];
    args.extend(fixture_args(name));
    args.extend(extra.iter().map(|s| s.to_string()));
    stdout_ok(&planner(&args), &format!("kvshard-plan on {name}"))
}

/// A line diff (longest common subsequence), "-" expected, "+" actual.
fn diff(expected: &str, actual: &str) -> String {
    let a: Vec<&str> = expected.lines().collect();
    let b: Vec<&str> = actual.lines().collect();
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            out += &format!("@@ expected line {}\n-{}\n", i + 1, a[i]);
            i += 1;
        } else {
            out += &format!("@@ actual line {}\n+{}\n", j + 1, b[j]);
            j += 1;
        }
    }
    out
}

#[test]
fn fixture_plans_match_the_expected_ones() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        for (format, ext) in [("json", "expected.json"), ("text", "expected.txt")] {
            let path = deploy_dir().join("fixtures").join(format!("{name}.{ext}"));
            let expected = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let actual = fixture_plan(name, format, &[]);
            if actual != expected {
                failures.push(format!(
                    "{} differs from the planner's output:\n{}",
                    path.display(),
                    diff(&expected, &actual)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{}\n(if the change is intended: python3 tools/deploy/fixtures/make-fixtures.py --bless)",
        failures.join("\n")
    );
}

fn parse_list(s: &str) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => {
                out.insert(part.parse().unwrap());
            }
        }
    }
    out
}

/// The plan's own invariants: the unit's CPU set is the shards plus the front,
/// and the front is the one allowed CPU the shards leave out (where kvshard
/// pins it). No shard shares a core with vLLM or NIC IRQs.
fn check_invariants(plan: &Value, what: &str) {
    let cpus = &plan["cpus"];
    let shards = parse_list(cpus["shards"].as_str().unwrap());
    let front = cpus["front"].as_u64().unwrap() as usize;
    let affinity = parse_list(cpus["cpu_affinity"].as_str().unwrap());
    let mut expect = shards.clone();
    expect.insert(front);
    assert_eq!(affinity, expect, "{what}: CPUAffinity is shards + front");
    assert!(
        !shards.contains(&front),
        "{what}: the front has its own CPU"
    );
    assert_eq!(shards.len() as u64, cpus["shard_count"].as_u64().unwrap());
    let mut others = BTreeSet::new();
    for v in cpus["vllm"].as_array().unwrap() {
        others.extend(parse_list(v["cpus"].as_str().unwrap()));
    }
    for n in cpus["nic_irqs"].as_array().unwrap() {
        others.extend(parse_list(n["cpus"].as_str().unwrap()));
    }
    assert!(
        affinity.is_disjoint(&others),
        "{what}: kvshard's CPUs {affinity:?} overlap vLLM's or IRQs' {others:?}"
    );
    let cmd: Vec<&str> = plan["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let at = cmd.iter().position(|a| *a == "--cores").unwrap();
    assert_eq!(parse_list(cmd[at + 1]), shards, "{what}: --cores");
    assert_eq!(
        plan["systemd"]["CPUAffinity"].as_str().unwrap(),
        cpus["cpu_affinity"].as_str().unwrap()
    );
}

/// Every `--flag` in `kvshard server --help`.
fn server_flags() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvshard"))
        .args(["server", "--help"])
        .output()
        .unwrap();
    let help = stdout_ok(&out, "kvshard server --help");
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_owned)
        .collect()
}

fn emitted_flags(plan: &Value) -> Vec<String> {
    plan["command"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap().to_owned())
        .collect()
}

#[test]
fn fixture_plans_hold_together_and_emit_only_real_flags() {
    let flags = server_flags();
    for name in FIXTURES {
        let plan: Value = serde_json::from_str(&fixture_plan(name, "json", &[])).unwrap();
        check_invariants(&plan, name);
        for f in emitted_flags(&plan) {
            assert!(
                flags.contains(&f),
                "{name}: the plan emits {f}, which `kvshard server --help` does not list"
            );
        }
        // The other L1 mode as well.
        let other = if fixture_args(name).contains(&"hugetlb".to_string()) {
            "shm"
        } else {
            "hugetlb"
        };
        let plan: Value =
            serde_json::from_str(&fixture_plan(name, "json", &["--l1-mode", other])).unwrap();
        check_invariants(&plan, &format!("{name} --l1-mode {other}"));
        for f in emitted_flags(&plan) {
            assert!(flags.contains(&f), "{name} ({other}): emits unknown {f}");
        }
    }
}

#[test]
fn dry_run_is_the_default_and_apply_is_refused_on_a_fixture() {
    let name = FIXTURES[0];
    let plain = fixture_plan(name, "text", &[]);
    let dry = fixture_plan(name, "text", &["--dry-run"]);
    assert_eq!(plain, dry, "--dry-run is the default");
    assert!(!plain.contains("undo script:"), "a dry run applies nothing");

    let undo = std::env::temp_dir().join(format!("kvshard-plan-undo-{}.sh", std::process::id()));
    let mut args = vec![
        "--root".to_string(),
        fixture(name).display().to_string(),
        "--apply".to_string(),
        "--undo-file".to_string(),
        undo.display().to_string(),
    ];
    args.extend(fixture_args(name));
    let out = planner(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "--apply on a fixture: {stderr}");
    assert!(stderr.contains("refusing --apply"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing planned or applied");
    assert!(!undo.exists(), "no undo script for a refused --apply");

    // --apply and --dry-run exclude each other.
    let out = planner(&["--apply", "--dry-run"]);
    assert_eq!(out.status.code(), Some(2));

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let out = planner(&["--apply"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("needs root"), "{stderr}");
    } else {
        println!("running as root: the not-root refusal of --apply is not exercised");
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn healthcheck(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /healthcheck HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply.starts_with("HTTP/1.1 200")
}

/// This process's allowed CPUs, from /proc/self/status.
fn allowed_cpus() -> Option<BTreeSet<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))?;
    Some(parse_list(line.split(':').nth(1)?.trim()))
}

/// Kills the child on drop, so a failed assertion leaves no server behind.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// What became of a planned server: serving `/healthcheck`,
/// or exited, with its status and stderr.
enum Start {
    Serving(Server),
    Exited(std::process::ExitStatus, String),
}

/// Runs the plan's command on free loopback ports (the last of a repeated
/// flag wins), its stderr captured, until it serves `/healthcheck` or exits
/// (90 s at most). One that could not bind a port is started again on other
/// ports (3 tries in all): a port `free_port` found free can be taken by
/// another test's connection before the server binds it.
fn start_planned(cmd: &[String]) -> Start {
    const TRIES: u32 = 3;
    for attempt in 1..=TRIES {
        let (http, zmq) = (free_port(), free_port());
        let mut server = Server(
            Command::new(&cmd[0])
                .args(&cmd[1..])
                .args(["--host", "127.0.0.1", "--port", &zmq.to_string()])
                .args(["--http-host", "127.0.0.1", "--http-port", &http.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let t0 = Instant::now();
        loop {
            if let Some(status) = server.0.try_wait().unwrap() {
                let stderr = stderr_of(&mut server.0);
                if attempt < TRIES && stderr.contains("cannot bind") {
                    eprintln!("{stderr}\nstarting the plan's command again on other ports");
                    break;
                }
                return Start::Exited(status, stderr);
            }
            if healthcheck(http) {
                return Start::Serving(server);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(90),
                "the plan's command neither served /healthcheck nor stopped within 90 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    unreachable!("the last try returns")
}

fn machine_plan(extra: &[&str]) -> Value {
    let bin = env!("CARGO_BIN_EXE_kvshard");
    let mut args = vec!["--format", "json", "--kvshard-bin", bin];
    args.extend_from_slice(extra);
    serde_json::from_str(&stdout_ok(&planner(&args), "kvshard-plan on /")).unwrap()
}

fn command_of(plan: &Value) -> Vec<String> {
    plan["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_plan_for_this_machine_starts_a_kvshard_that_serves_and_stops_on_sigterm() {
    // The text form, with every default.
    let text = stdout_ok(&planner::<&str>(&[]), "kvshard-plan on /");
    assert!(text.contains("Command\n"), "{text}");

    let shm = format!("kvplan{}", std::process::id());
    let plan = machine_plan(&["--l1-size-gb", "0.0625", "--shm-name", &shm]);
    check_invariants(&plan, "this machine");
    let flags = server_flags();
    for f in emitted_flags(&plan) {
        assert!(flags.contains(&f), "this machine: emits unknown {f}");
    }
    let affinity = parse_list(plan["cpus"]["cpu_affinity"].as_str().unwrap());
    match allowed_cpus() {
        Some(allowed) if !affinity.is_subset(&allowed) => {
            println!(
                "skipping the start: the plan's CPUs {affinity:?} are not all allowed to this test ({allowed:?})"
            );
            return;
        }
        _ => {}
    }

    let segment = PathBuf::from(format!("/dev/shm/lmcache_l1_pool_{shm}"));
    let mut server = match start_planned(&command_of(&plan)) {
        Start::Serving(server) => server,
        Start::Exited(status, stderr) => {
            panic!("kvshard exited ({status}) before serving:\n{stderr}")
        }
    };
    assert!(segment.exists(), "{} while serving", segment.display());

    // The unit stops it with SIGTERM: it must exit 0 and remove its segment.
    // SAFETY: kill on the pid of a child we own and have not reaped.
    assert_eq!(
        unsafe { libc::kill(server.0.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let status = wait_exit(&mut server.0, Duration::from_secs(60))
        .expect("kvshard stops within 60 s of SIGTERM");
    let stderr = stderr_of(&mut server.0);
    assert!(status.success(), "exit after SIGTERM: {status}\n{stderr}");
    assert!(
        !segment.exists(),
        "{} left behind after SIGTERM",
        segment.display()
    );

    // The hugetlb plan's flags pass kvshard's configuration: it either starts
    // or stops at the arena (pool too small here), never at argument checks
    // (exit status 2).
    let plan = machine_plan(&["--l1-size-gb", "0.0625", "--l1-mode", "hugetlb"]);
    if let Start::Exited(status, stderr) = start_planned(&command_of(&plan)) {
        assert_ne!(status.code(), Some(2), "hugetlb plan refused:\n{stderr}");
        assert!(stderr.contains("hugetlb"), "{stderr}");
    }
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn the_unit_and_the_shell_scripts_lint_clean() {
    let dir = std::env::temp_dir().join(format!("kvshard-deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let have_analyze = have("systemd-analyze");
    let have_shellcheck = have("shellcheck");
    if !have_analyze {
        println!("skipping systemd-analyze verify: systemd-analyze is not installed (tools/deploy/check.sh installs it)");
    }
    if !have_shellcheck {
        println!(
            "skipping shellcheck: shellcheck is not installed (tools/deploy/check.sh installs it)"
        );
    } else {
        let out = Command::new("shellcheck")
            .arg(deploy_dir().join("check.sh"))
            .output()
            .unwrap();
        stdout_ok(&out, "shellcheck tools/deploy/check.sh");
    }
    for name in FIXTURES {
        let units = dir.join(name).join("units");
        let dropin = units.join("kvshard.service.d/plan.conf");
        let undo = dir.join(name).join("undo.sh");
        std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
        std::fs::copy(
            deploy_dir().join("kvshard.service"),
            units.join("kvshard.service"),
        )
        .unwrap();
        let plan: Value = serde_json::from_str(&fixture_plan(
            name,
            "json",
            &[
                "--kvshard-bin",
                env!("CARGO_BIN_EXE_kvshard"),
                "--emit-dropin",
                dropin.to_str().unwrap(),
                "--emit-undo",
                undo.to_str().unwrap(),
            ],
        ))
        .unwrap();

        // The drop-in carries the plan.
        let text = std::fs::read_to_string(&dropin).unwrap();
        let affinity = format!(
            "\nCPUAffinity={}\n",
            plan["systemd"]["CPUAffinity"].as_str().unwrap()
        );
        assert!(text.contains(&affinity), "{name}: {text}");
        assert!(text.contains("\nLimitMEMLOCK=infinity\n"), "{name}: {text}");
        assert!(text.contains("\nExecStart=\nExecStart="), "{name}: {text}");
        let exec = text.lines().find(|l| l.starts_with("ExecStart=/")).unwrap();
        assert!(
            exec.ends_with(
                plan["command_line"]
                    .as_str()
                    .unwrap()
                    .split_once(" server ")
                    .unwrap()
                    .1
            ),
            "{name}: {exec}"
        );
        assert!(
            !text.contains('@'),
            "{name}: unfilled placeholder in {text}"
        );

        if have_shellcheck {
            let out = Command::new("shellcheck").arg(&undo).output().unwrap();
            stdout_ok(&out, &format!("shellcheck on the undo script of {name}"));
        }
        if have_analyze {
            let out = Command::new("systemd-analyze")
                .arg("verify")
                .arg(units.join("kvshard.service"))
                .current_dir(dir.join(name))
                .output()
                .unwrap();
            let all = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && !all.contains("kvshard.service"),
                "systemd-analyze verify, drop-in of {name}:\n{all}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
