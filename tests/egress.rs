//! Egress by allowlist: a tenant the operator granted egress reaches the hosts on the proxy's
//! allowlist, through the proxy, and nothing else; another tenant's sandboxes stay out of its
//! reach; a tenant without egress has no network at all. Everything runs on this machine: the
//! package index is a project container this test starts on the proxy's upstream network.
//!
//! Needs the stack as `deploy/local/test.sh` sets it up: `deploy/local/egress.sh up` for the
//! tenants in `SANDCELL_EGRESS_TEST_TENANTS` with `sandcell-test-index` allowed, and the worker
//! started with the matching settings.

use std::process::Command;
use std::time::Duration;

use sandcell_protocol::{JobStatus, Language, Submission};
use sandcell_tests::*;

/// The index's container (and host name); the only name on the proxy's allowlist.
const INDEX: &str = "sandcell-test-index";
/// Serves a PEP 503 index with one wheel the image does not have, built at start.
const INDEX_SERVER: &str = r#"
import base64, functools, hashlib, http.server, io, os, zipfile
root = '/tmp/srv'
os.makedirs(root + '/simple/sandcell-probe')
files = {
    'sandcell_probe/__init__.py': "VALUE = 'installed through the proxy'\n",
    'sandcell_probe-1.0.dist-info/METADATA': 'Metadata-Version: 2.1\nName: sandcell-probe\nVersion: 1.0\n',
    'sandcell_probe-1.0.dist-info/WHEEL': 'Wheel-Version: 1.0\nGenerator: sandcell-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
}
record, buf = [], io.BytesIO()
with zipfile.ZipFile(buf, 'w') as z:
    for name, text in files.items():
        data = text.encode()
        z.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
        record.append('%s,sha256=%s,%d' % (name, digest, len(data)))
    record.append('sandcell_probe-1.0.dist-info/RECORD,,')
    z.writestr('sandcell_probe-1.0.dist-info/RECORD', '\n'.join(record) + '\n')
wheel = 'sandcell_probe-1.0-py3-none-any.whl'
open(root + '/simple/sandcell-probe/' + wheel, 'wb').write(buf.getvalue())
open(root + '/simple/sandcell-probe/index.html', 'w').write('<a href="%s">%s</a>' % (wheel, wheel))
open(root + '/simple/index.html', 'w').write('<a href="sandcell-probe/">sandcell-probe</a>')
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
http.server.ThreadingHTTPServer(('', 8080), handler).serve_forever()
"#;

/// The two tenants granted egress (each on a network of its own).
fn egress_tenants() -> (String, String) {
    let list = std::env::var("SANDCELL_EGRESS_TEST_TENANTS").expect("SANDCELL_EGRESS_TEST_TENANTS: run through deploy/local/test.sh");
    let mut it = list.split(',').map(str::to_string);
    (it.next().expect("a first tenant"), it.next().expect("a second tenant"))
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap_or_else(|e| panic!("docker {args:?}: {e}"));
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The package index, on the proxy's upstream network only; removed when dropped.
struct Index {
    ip: String,
}

impl Index {
    async fn start() -> Index {
        let image = std::env::var("SANDCELL_SANDBOX_IMAGE").expect("SANDCELL_SANDBOX_IMAGE");
        let upstream = std::env::var("SANDCELL_EGRESS_UPSTREAM").unwrap_or_else(|_| "sandcell-egress-out".into());
        let _ = Command::new("docker").args(["rm", "-f", INDEX]).output();
        docker(&[
            "run",
            "-d",
            "--name",
            INDEX,
            "--network",
            &upstream,
            "--user",
            "1000:1000",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            &image,
            "python3",
            "-c",
            INDEX_SERVER,
        ]);
        let up = eventually(Duration::from_secs(30), || async {
            let probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/simple/', timeout=2)";
            Command::new("docker").args(["exec", INDEX, "python3", "-c", probe]).output().ok().filter(|o| o.status.success())
        })
        .await;
        assert!(up.is_some(), "the index did not come up");
        let ip = docker(&["inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", INDEX]);
        Index { ip }
    }
}

impl Drop for Index {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", INDEX]).output();
    }
}

fn in_session_as(tenant: &str, sid: &str, language: Language, code: &str) -> Submission {
    let mut s = in_session(tenant, sid, code);
    s.language = language;
    s
}

/// Python that tries each destination and prints `name: reached|refused <status>|failed`.
fn probes(targets: &[(&str, String)]) -> String {
    let mut code = String::from(
        "import socket, urllib.request, urllib.error\n\
         def url(u):\n    try:\n        urllib.request.urlopen(u, timeout=10)\n        return 'reached'\n    \
         except urllib.error.HTTPError as e:\n        return 'refused %d' % e.code\n    except Exception:\n        return 'failed'\n\
         def tcp(host, port):\n    s = socket.socket()\n    s.settimeout(3)\n    try:\n        s.connect((host, port))\n        return 'reached'\n    \
         except Exception:\n        return 'failed'\n    finally:\n        s.close()\n",
    );
    for (name, call) in targets {
        code.push_str(&format!("print({name:?} + ': ' + {call})\n"));
    }
    code
}

fn outcomes(stdout: &str) -> Vec<(String, String)> {
    stdout.lines().filter_map(|l| l.split_once(": ")).map(|(a, b)| (a.to_string(), b.to_string())).collect()
}

#[tokio::test]
async fn a_granted_tenant_installs_a_package_through_the_proxy_and_reaches_nothing_else() {
    let c = client().await;
    let (tenant, _) = egress_tenants();
    let index = Index::start().await;
    let sid = session_id(&run(&c, &open_session(&tenant, "import os", Some(120))).await);

    // pip through the proxy (HTTP_PROXY is set for this tenant's sandboxes), into the user's site;
    // the next cell imports it.
    let pip = format!("pip install --index-url http://{INDEX}:8080/simple/ --trusted-host {INDEX} sandcell-probe");
    let r = run(&c, &in_session_as(&tenant, &sid, Language::Bash, &pip)).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let r = run(&c, &in_session(&tenant, &sid, "import sandcell_probe\nsandcell_probe.VALUE")).await;
    assert_eq!(value(&r).as_deref(), Some("'installed through the proxy'"), "{r:?}");

    // Everything else fails: other hosts and addresses through the proxy, and anything direct.
    let targets = [
        ("the index, through the proxy", format!("url('http://{INDEX}:8080/simple/')")),
        ("another host, through the proxy", "url('http://example.com/')".to_string()),
        ("the broker's address, through the proxy", "url('http://127.0.0.1:5672/')".to_string()),
        ("the database's address, through the proxy", "url('http://127.0.0.1:5432/')".to_string()),
        ("the store's address, through the proxy", "url('http://127.0.0.1:3900/')".to_string()),
        ("the index by address, through the proxy", format!("url('http://{}:8080/simple/')", index.ip)),
        ("the index over CONNECT, through the proxy", format!("url('https://{INDEX}:8080/simple/')")),
        ("the index, direct", format!("tcp('{INDEX}', 8080)")),
        ("the index by address, direct", format!("tcp('{}', 8080)", index.ip)),
        ("the broker, direct", "tcp('127.0.0.1', 5672)".to_string()),
        ("the proxy on another port", "tcp('sandcell-egress-proxy', 22)".to_string()),
        ("the host's resolver, direct", "tcp('10.255.255.53', 53)".to_string()),
        ("a public address, direct", "tcp('1.1.1.1', 443)".to_string()),
    ];
    let mut sub = in_session(&tenant, &sid, &probes(&targets));
    sub.timeout_ms = Some(120_000);
    let r = run(&c, &sub).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let got = outcomes(&r.execution.stdout);
    eprintln!("{got:#?}");
    assert_eq!(got.len(), targets.len(), "{r:?}");
    assert_eq!(got[0].1, "reached", "the allowed host is reachable: {got:?}");
    for (name, outcome) in &got[1..] {
        assert_ne!(outcome, "reached", "{name} was reached: {got:?}");
    }
    // The proxy itself says no to what is not on its list.
    assert_eq!(got[1].1, "refused 403", "{got:?}");
}

#[tokio::test]
async fn granted_tenants_cannot_reach_each_others_sandboxes_and_others_have_no_network() {
    let c = client().await;
    let (a, b) = egress_tenants();
    // A's session serves on port 8000 from a thread of its kernel, and can reach itself.
    let serve = "import http.server, socket, threading\n\
                 srv = http.server.ThreadingHTTPServer(('', 8000), http.server.SimpleHTTPRequestHandler)\n\
                 threading.Thread(target=srv.serve_forever, daemon=True).start()\n\
                 socket.gethostbyname(socket.gethostname())";
    let open = run(&c, &open_session(&a, serve, Some(120))).await;
    let ip = value(&open).expect("A's address").trim_matches('\'').to_string();
    let sid = session_id(&open);
    let itself = run(&c, &in_session(&a, &sid, &probes(&[("itself", "tcp('127.0.0.1', 8000)".to_string())]))).await;
    assert_eq!(outcomes(&itself.execution.stdout), [("itself".to_string(), "reached".to_string())], "{itself:?}");

    // B, also granted egress, on its own network: neither directly nor through the proxy.
    let targets = [("A, direct", format!("tcp('{ip}', 8000)")), ("A, through the proxy", format!("url('http://{ip}:8000/')"))];
    let r = run(&c, &python(&b, &probes(&targets))).await;
    assert_eq!(r.status, JobStatus::Succeeded, "{r:?}");
    let got = outcomes(&r.execution.stdout);
    assert_eq!(got.len(), 2, "{r:?}");
    assert!(got.iter().all(|(_, o)| o != "reached"), "{got:?}");

    // A tenant without egress: no network, no proxy.
    let r = run(&c, &python(&tenant(), &probes(&[("the proxy", "url('http://example.com/')".to_string()), ("A", format!("tcp('{ip}', 8000)"))]))).await;
    let got = outcomes(&r.execution.stdout);
    assert_eq!(got.len(), 2, "{r:?}");
    assert!(got.iter().all(|(_, o)| o == "failed"), "{got:?}");
}
