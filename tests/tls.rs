//! Upstreams and PostgreSQL behind a private CA (docs/CONFIGURATION.md, "TLS"): the
//! test makes its own CA and a server certificate for `localhost` (rcgen), serves the
//! mock upstream over HTTPS with it ([`TlsFront`]), and runs the program against it —
//! trusted through `POLYGW_CA_FILE`, refused without it, and a bad file named; and it
//! starts a PostgreSQL server of its own with TLS on (`initdb` + `postgres`) for the
//! telemetry URL's `sslrootcert`.

use std::process::{Command, Output};

use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream, TlsFront};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

const BIN: &str = env!("CARGO_BIN_EXE_polygw-under-test");

/// A private CA (PEM) and a server certificate chain + key it signed for `localhost`.
#[derive(Clone)]
struct Pki {
    ca_pem: String,
    chain_pem: String,
    key_pem: String,
}

fn pki() -> Pki {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "polygw test private CA");
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("server key");
    let server = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .expect("server params");
    let cert = server.signed_by(&key, &issuer).expect("server certificate");
    Pki {
        ca_pem: ca_cert.pem(),
        chain_pem: format!("{}{}", cert.pem(), ca_cert.pem()),
        key_pem: key.serialize_pem(),
    }
}

fn chat(base_url: &str, ca_file: Option<&std::path::Path>) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(["chat", "hi"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LLM__S__0__BASE_URL", base_url)
        .env("LLM__S__0__API_KEY", "")
        .env("LLM__S__0__MODEL", "m")
        .env("LLM__RETRY__MAX_ATTEMPTS", "1");
    // The system store must not decide the outcome: point it at an empty bundle.
    let empty = tempfile::NamedTempFile::new().expect("temp file");
    cmd.env("SSL_CERT_FILE", empty.path());
    if let Some(f) = ca_file {
        cmd.env("POLYGW_CA_FILE", f);
    }
    cmd.output().expect("the program runs")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

async fn run(base_url: String, ca_file: Option<std::path::PathBuf>) -> Output {
    tokio::task::spawn_blocking(move || chat(&base_url, ca_file.as_deref()))
        .await
        .expect("the program's runner")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_behind_a_private_ca_is_reached_with_polygw_ca_file() {
    let p = pki();
    let mock = MockUpstream::start(MockConfig::default()).await.unwrap();
    mock.set_default(Behavior::text(&["Hello", " over TLS"]));
    let front = TlsFront::start(mock.addr(), &p.chain_pem, &p.key_pem)
        .await
        .expect("the TLS front");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("private-ca.pem");
    std::fs::write(&ca_file, &p.ca_pem).unwrap();

    // Trusted through the CA file: the answer comes back over HTTPS.
    let o = run(front.base_url("localhost"), Some(ca_file.clone())).await;
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("Hello over TLS"), "{t}");
    assert_eq!(mock.requests().len(), 1, "{t}");

    // Without it the certificate is not trusted: no request reaches the upstream.
    let o = run(front.base_url("localhost"), None).await;
    let t = text(&o);
    assert!(
        !o.status.success(),
        "an unknown CA must not be trusted: {t}"
    );
    assert!(
        t.contains("connect"),
        "a TLS failure is a connect failure: {t}"
    );
    assert_eq!(mock.requests().len(), 1, "{t}");

    // A CA file that cannot be read is named, not ignored.
    let missing = dir.path().join("missing.pem");
    let o = run(front.base_url("localhost"), Some(missing)).await;
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("POLYGW_CA_FILE"), "{t}");

    // A file with no certificate in it is named too.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let o = run(front.base_url("localhost"), Some(junk)).await;
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("POLYGW_CA_FILE"), "{t}");
}

// ------------------------------------------------ PostgreSQL behind a private CA

/// A PostgreSQL server this test starts (`initdb` + `postgres`, from the PATH or
/// Debian's `/usr/lib/postgresql/*/bin`) on a free port of 127.0.0.1 with TLS on and a
/// certificate from the test's own CA. As root, the server runs as `postgres` (it
/// refuses root). Killed when dropped.
struct PgTls {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for PgTls {
    fn drop(&mut self) {
        // Immediate shutdown (SIGQUIT): the postmaster stops its backends and exits;
        // SIGKILL only if it has not within 5 s.
        let _ = Command::new("kill")
            .args(["-QUIT", &self.child.id().to_string()])
            .status();
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pg_bin(name: &str) -> Option<std::path::PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    });
    on_path.or_else(|| {
        let mut dirs: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
            .filter(|f| f.is_file())
            .collect();
        dirs.sort();
        dirs.pop()
    })
}

/// Runs `bin args` as the user PostgreSQL runs as (`postgres` when this is root;
/// `setpriv` execs, so the child is the program itself and can be signalled).
fn as_pg_user(bin: &std::path::Path, root: bool) -> Command {
    if root {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            "postgres",
            "--regid",
            "postgres",
            "--init-groups",
            "--",
        ])
        .arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

/// The `postgres` user's uid (`-u`) or gid (`-g`).
fn postgres_id(flag: &str) -> Result<u32, String> {
    let out = Command::new("id")
        .args([flag, "postgres"])
        .output()
        .map_err(|e| e.to_string())?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("no postgres user (id {flag} postgres)"))
}

fn start_pg_tls(p: &Pki) -> Result<PgTls, String> {
    use std::os::unix::fs::PermissionsExt;
    let (initdb, postgres) = match (pg_bin("initdb"), pg_bin("postgres")) {
        (Some(i), Some(p)) => (i, p),
        _ => return Err("initdb/postgres not found".into()),
    };
    // Whether this runs as root: the owner of /proc/self.
    let root = std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let (uid, gid) = if root {
        (Some(postgres_id("-u")?), Some(postgres_id("-g")?))
    } else {
        (None, None)
    };
    std::os::unix::fs::chown(dir.path(), uid, gid).map_err(|e| e.to_string())?;
    let o = as_pg_user(&initdb, root)
        .arg("-D")
        .arg(&data)
        .args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "--no-instructions",
        ])
        .output()
        .map_err(|e| format!("initdb: {e}"))?;
    if !o.status.success() {
        return Err(format!("initdb: {}", String::from_utf8_lossy(&o.stderr)));
    }
    let (crt, key) = (data.join("server.crt"), data.join("server.key"));
    std::fs::write(&crt, &p.chain_pem).map_err(|e| e.to_string())?;
    std::fs::write(&key, &p.key_pem).map_err(|e| e.to_string())?;
    for f in [&crt, &key] {
        std::os::unix::fs::chown(f, uid, gid).map_err(|e| e.to_string())?;
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| e.to_string())?;
    }
    let port = polygw_testkit::services::free_port()?;
    let child = as_pg_user(&postgres, root)
        .arg("-D")
        .arg(&data)
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
        .arg("-k")
        .arg(dir.path())
        .args(["-c", "ssl=on", "-c", "fsync=off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("postgres: {e}"))?;
    let mut pg = PgTls {
        child,
        port,
        _dir: dir,
    };
    for _ in 0..200 {
        if let Ok(Some(status)) = pg.child.try_wait() {
            return Err(format!("postgres exited: {status}"));
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(pg);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Err("postgres did not listen within 10 s".into())
}

/// Telemetry to a PostgreSQL server whose certificate a private CA signed: trusted
/// through `sslrootcert` in the URL (docs/CONFIGURATION.md), refused without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_behind_a_private_ca_is_reached_with_sslrootcert() {
    let p = pki();
    let pg = match tokio::task::spawn_blocking({
        let p = p.clone();
        move || start_pg_tls(&p)
    })
    .await
    .unwrap()
    {
        Ok(pg) => pg,
        Err(why) if !polygw_testkit::services::in_ci() => {
            eprintln!("skipping: cannot start a TLS PostgreSQL server: {why}");
            return;
        }
        Err(why) => panic!("a TLS PostgreSQL server is required under CI=true: {why}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("private-ca.pem");
    std::fs::write(&ca_file, &p.ca_pem).unwrap();
    let base = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full",
        pg.port
    );
    let trusted = format!("{base}&sslrootcert={}", ca_file.display());

    let mock = MockUpstream::start(MockConfig::default()).await.unwrap();
    mock.set_default(Behavior::text(&["Hello", " with TLS telemetry"]));
    let run_chat = |url: String| {
        let base_url = mock.base_url();
        tokio::task::spawn_blocking(move || {
            Command::new(BIN)
                .args(["chat", "hi"])
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("LLM__S__0__BASE_URL", base_url)
                .env("LLM__S__0__API_KEY", "")
                .env("LLM__S__0__MODEL", "m")
                .env("LLM__TELEMETRY__URL", url)
                .output()
                .expect("the program runs")
        })
    };
    // Trusted through sslrootcert: the call's row lands in the database.
    let o = run_chat(trusted.clone()).await.unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let rows = polygw_telemetry_sql::read_rows(&trusted, None)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{t}");
    assert!(rows[0].ok);

    // Without it (the webpki roots) the server's certificate is refused, and the
    // failure says so.
    let e = polygw_telemetry_sql::read_rows(&base, None)
        .await
        .expect_err("an unknown CA must not be trusted");
    let msg = format!("{e:#}").to_lowercase();
    assert!(
        msg.contains("certificate") || msg.contains("tls") || msg.contains("issuer"),
        "{msg}"
    );
}
