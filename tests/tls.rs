//! Upstreams behind a private CA (docs/CONFIGURATION.md, "TLS"): the test makes its
//! own CA and a server certificate for `localhost` (rcgen), serves the mock upstream
//! over HTTPS with it ([`TlsFront`]), and runs the program against it — trusted
//! through `POLYGW_CA_FILE`, refused without it, and a bad file named.

use std::process::{Command, Output};

use polygw_mock_upstream::{Behavior, MockConfig, MockUpstream, TlsFront};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

const BIN: &str = env!("CARGO_BIN_EXE_polygw-under-test");

/// A private CA (PEM) and a server certificate chain + key it signed for `localhost`.
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
