//! The server under careless and hostile clients (issue 15, "Tried as an attacker and a
//! careless operator would"), from the outside: raw sockets, the paused clock wherever
//! a timeout is the subject (time jumps while everything waits; nothing sleeps to hit
//! a window).

use std::net::SocketAddr;
use std::time::Duration;

use polygw::ScopeKind;
use polygw_mock_upstream::{Behavior, EndKind, Stall};
use polygw_serve::{Proxy, ProxyConfig, ServerLimits};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

use crate::support::*;

fn limits() -> ServerLimits {
    ServerLimits::default()
}

/// A connection from another loopback address (127.0.0.2): another client.
async fn connect_from(ip: &str, addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    s.connect(addr).await.unwrap()
}

fn assert_openai_error(r: &Raw, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}\n{}", r.head, r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    assert!(r.header("x-request-id").is_some(), "{}", r.head);
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{}",
        r.head
    );
}

#[tokio::test(start_paused = true)]
async fn a_head_that_does_not_arrive_in_time_gets_a_408_and_the_connection_closes() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig::default(),
        ServerLimits {
            header_timeout: Duration::from_secs(5),
            ..limits()
        },
    )
    .await;
    // Half a head, then nothing (slowloris).
    let started = Instant::now();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .await
        .unwrap();
    let r = parse_raw(&read_to_close(&mut c).await);
    assert_openai_error(&r, 408, "request_timeout");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(6),
        "{took:?}"
    );
    // A connection that sends nothing at all gets the same.
    let started = Instant::now();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let r = parse_raw(&read_to_close(&mut c).await);
    assert_openai_error(&r, 408, "request_timeout");
    assert!(started.elapsed() >= Duration::from_secs(5));
    // /healthz still answers.
    let r = parse_raw(
        &raw_exchange(
            s.addr,
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await,
    );
    assert_eq!(r.status, 200);
}

#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_is_closed() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig::default(),
        ServerLimits {
            idle_timeout: Duration::from_secs(20),
            header_timeout: Duration::from_secs(5),
            ..limits()
        },
    )
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    for _ in 0..2 {
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(read_one(&mut c).await.status, 200);
    }
    // Idle between requests: the longer idle bound applies, not the header one.
    let started = Instant::now();
    let rest = read_to_close(&mut c).await;
    let took = started.elapsed();
    assert!(rest.is_empty(), "closed quietly: {rest:?}");
    assert!(
        took >= Duration::from_secs(20) && took < Duration::from_secs(21),
        "{took:?}"
    );
    let metrics = http()
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("polygw_proxy_connections_closed_total{reason=\"idle\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_body_that_does_not_arrive_in_time_gets_a_408() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            body_timeout: Duration::from_secs(7),
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        .await
        .unwrap();
    let started = Instant::now();
    let r = parse_raw(&read_to_close(&mut c).await);
    assert_openai_error(&r, 408, "request_timeout");
    assert_eq!(r.header("connection").as_deref(), Some("close"));
    assert!(started.elapsed() >= Duration::from_secs(7));
    assert!(m.requests().is_empty());
}

/// A client that writes a request's head and its body separately (Python's
/// `http.client`: two sends) gets every answer at once. A read that drained the socket
/// used to forget the socket's readiness as taken *after* the read, and with it the
/// event of a body that arrived in between: the request then waited for
/// `--body-timeout-s` and got a 408. That race showed against a release binary driven
/// by Python's `urllib` from 8 threads (2 of 3 000 calls; 0 of 9 000 since the fix,
/// docs/DECISIONS.md 188); this debug-build test has not reproduced it in-process, so
/// it guards the shape of the traffic (head, a gap swept over some 0–100 µs, body; blocking
/// clients on their own threads), not the race itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_written_after_its_head_is_never_left_waiting() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            body_timeout: Duration::from_secs(3),
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let body = br#"{"model":"LLM","messages":[{"role":"user","content":"hi"}]}"#;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let addr = s.addr;
    // Blocking clients on their own threads (as Python's are), outside the server's
    // runtime and its I/O driver.
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let head = head.clone();
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                let mut statuses = Vec::new();
                for i in 0..200u64 {
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    c.set_nodelay(true).unwrap();
                    c.write_all(head.as_bytes()).unwrap();
                    // The gap between the two writes swept over 0–100 µs or so, where the
                    // server reads the head and takes the socket's readiness.
                    for _ in 0..(i % 101) * 100 {
                        std::hint::spin_loop();
                    }
                    c.write_all(body).unwrap();
                    let mut answer = Vec::new();
                    c.read_to_end(&mut answer).unwrap();
                    statuses.push(parse_raw(&answer).status);
                }
                statuses
            })
        })
        .collect();
    let statuses: Vec<u16> = tokio::task::spawn_blocking(move || {
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    })
    .await
    .unwrap();
    let late = statuses.iter().filter(|s| **s != 200).count();
    assert_eq!(
        late,
        0,
        "{late} of {} requests were not answered 200",
        statuses.len()
    );
}

#[tokio::test]
async fn heads_over_64_kib_or_with_too_many_fields_get_a_431() {
    let m = mock(Behavior::default()).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    // One huge header (70 KiB): refused as it arrives.
    let mut head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 70 * 1024));
    head.extend_from_slice(b"\r\n\r\n");
    let r = parse_raw(&raw_exchange(s.addr, &head).await);
    assert_openai_error(&r, 431, "request_header_fields_too_large");
    // 200 small headers: hyper's own limit, with our body.
    let mut head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n".to_vec();
    for i in 0..200 {
        head.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
    }
    head.extend_from_slice(b"\r\n");
    let r = parse_raw(&raw_exchange(s.addr, &head).await);
    assert_openai_error(&r, 431, "request_header_fields_too_large");
    // A head just under the limit is fine.
    let mut head =
        b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nX-Big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 60 * 1024));
    head.extend_from_slice(b"\r\n\r\n");
    assert_eq!(parse_raw(&raw_exchange(s.addr, &head).await).status, 200);
}

#[tokio::test]
async fn every_error_status_has_an_openai_body() {
    let m = mock(Behavior::default()).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        // A malformed header line: hyper refuses it; the body is ours.
        (b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nBad Header Line\r\n\r\n".to_vec(), 400, "bad_request"),
        (b"GET /healthz HTTP/9.9\r\nHost: localhost\r\n\r\n".to_vec(), 400, "bad_request"),
        (b"GET /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".to_vec(), 405, "method_not_allowed"),
        (b"DELETE /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".to_vec(), 405, "method_not_allowed"),
        (b"GET /nope HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".to_vec(), 404, "not_found"),
        (format!("GET /healthz?{} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", "q".repeat(9000)).into_bytes(), 414, "uri_too_long"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 99999999\r\n\r\n".to_vec(), 413, "body_too_large_marker"),
    ];
    for (req, status, code) in cases {
        let r = parse_raw(&raw_exchange(s.addr, &req).await);
        if code == "body_too_large_marker" {
            assert_eq!(r.status, status, "{}", r.body);
            assert_eq!(r.json()["error"]["param"], "body");
            assert_eq!(r.header("connection").as_deref(), Some("close"));
            continue;
        }
        assert_openai_error(&r, status, code);
    }
}

#[tokio::test]
async fn connections_are_capped_per_client_and_in_total() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig::default(),
        ServerLimits {
            max_connections_per_client: 2,
            max_connections: 3,
            ..limits()
        },
    )
    .await;
    // Two idle connections from 127.0.0.1, then a third from it: refused (429).
    let _a = TcpStream::connect(s.addr).await.unwrap();
    let _b = TcpStream::connect(s.addr).await.unwrap();
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let r = parse_raw(&read_to_close(&mut c).await);
    assert_openai_error(&r, 429, "too_many_connections");
    // Another client still gets in, and /healthz answers.
    let mut d = connect_from("127.0.0.2", s.addr).await;
    d.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_one(&mut d).await.status, 200);
    // Three open in total: a fourth client is refused (503).
    let mut e = connect_from("127.0.0.3", s.addr).await;
    let r = parse_raw(&read_to_close(&mut e).await);
    assert_openai_error(&r, 503, "too_many_connections");
    // Closing one frees its place.
    drop(d);
    let mut ok = false;
    for _ in 0..100 {
        let mut f = connect_from("127.0.0.4", s.addr).await;
        f.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        if parse_raw(&read_to_close(&mut f).await).status == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ok, "a freed place is taken again");
    // The refusals are counted, by cap. (Asked from a client of its own, with
    // `Connection: close`, once a place is free again.)
    let mut body = String::new();
    for _ in 0..100 {
        let mut g = connect_from("127.0.0.5", s.addr).await;
        g.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let r = parse_raw(&read_to_close(&mut g).await);
        if r.status == 200 {
            body = r.body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let count = |outcome: &str| -> u64 {
        let head = format!("polygw_proxy_connections_total{{outcome=\"{outcome}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(head.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {outcome} count in: {body}"))
    };
    assert_eq!(count("refused_per_client"), 1);
    assert!(count("refused_total") >= 1);
    assert!(count("accepted") >= 4);
}

#[tokio::test]
async fn without_keys_only_local_json_requests_are_served() {
    let m = mock(Behavior::text(&["ok"])).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            allowed_hosts: vec!["proxy.internal:8080".into()],
            allowed_origins: vec!["https://app.internal".into()],
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let body = chat_body("llm", false);
    let send = |extra: String, ct: &'static str| {
        let body = body.clone();
        async move {
            let req = format!(
                "POST /v1/chat/completions HTTP/1.1\r\n{extra}Content-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            parse_raw(&raw_exchange(s.addr, req.as_bytes()).await)
        }
    };
    // A DNS-rebinding page: Host is the attacker's name.
    let r = send("Host: evil.example:8080\r\n".into(), "application/json").await;
    assert_openai_error(&r, 403, "forbidden_host");
    // A cross-site page: Origin is the attacker's.
    let r = send(
        "Host: 127.0.0.1\r\nOrigin: https://evil.example\r\n".into(),
        "application/json",
    )
    .await;
    assert_openai_error(&r, 403, "forbidden_origin");
    let r = send(
        "Host: 127.0.0.1\r\nOrigin: null\r\n".into(),
        "application/json",
    )
    .await;
    assert_openai_error(&r, 403, "forbidden_origin");
    // A form post (no preflight): not JSON.
    let r = send("Host: 127.0.0.1\r\n".into(), "text/plain").await;
    assert_openai_error(&r, 415, "unsupported_media_type");
    // Local clients, allowed names and origins.
    for extra in [
        "Host: 127.0.0.1\r\n",
        "Host: localhost:8080\r\n",
        "Host: [::1]:8080\r\n",
        "Host: proxy.internal:8080\r\n",
        "Host: localhost\r\nOrigin: http://localhost:3000\r\n",
        "Host: localhost\r\nOrigin: https://app.internal\r\n",
    ] {
        let r = send(extra.into(), "application/json; charset=utf-8").await;
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
    assert_eq!(m.requests().len(), 6);
    // With client keys the key is the check: any Host, but a key.
    let keyed = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            client_keys: vec!["k1".into()],
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.example\r\nAuthorization: Bearer k1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    assert_eq!(
        parse_raw(&raw_exchange(keyed.addr, req.as_bytes()).await).status,
        200
    );
}

#[tokio::test]
async fn failed_authentications_are_counted() {
    let m = mock(Behavior::default()).await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            client_keys: vec!["right".into()],
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    for key in ["wrong", "", "right-ish"] {
        let r = http()
            .get(format!("{}/models", s.v1()))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
    }
    let r = http()
        .get(format!("{}/models", s.v1()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let metrics = http()
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("polygw_proxy_auth_failures_total 4"),
        "{metrics}"
    );
    assert_eq!(s.proxy.counters().auth_failures(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_scope_caps_its_running_calls_and_its_queue() {
    let m = mock(Behavior {
        ttft_ms: 2_000.0,
        ..Behavior::text(&["slow"])
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            max_calls_per_scope: 1,
            max_queued_per_scope: 1,
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let v1 = s.v1();
    let call = move || {
        let v1 = v1.clone();
        tokio::spawn(async move {
            let r = http()
                .post(format!("{v1}/chat/completions"))
                .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    let first = call();
    eventually("the first call reached the upstream", || {
        m.requests().len() == 1
    })
    .await;
    let second = call();
    let metrics_url = format!("{}/metrics", s.base);
    loop {
        let t = http()
            .get(&metrics_url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if t.contains("polygw_proxy_scope_calls{scope=\"LLM\",state=\"waiting\"} 1") {
            break;
        }
        tokio::task::yield_now().await;
    }
    // Running 1, waiting 1: the third is turned away at once.
    let (status, body) = call().await.unwrap();
    assert_eq!(status, 429, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(second.await.unwrap().0, 200);
    assert_eq!(
        m.requests().len(),
        2,
        "never more upstream calls than the cap"
    );
}

#[tokio::test]
async fn http2_is_not_served_and_does_not_hang() {
    let m = mock(Behavior::default()).await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let e = h2
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap_err();
    assert!(!e.is_timeout(), "refused at once: {e}");
    // HTTP/1.1 clients are unaffected.
    assert_eq!(
        http()
            .get(format!("{}/healthz", s.base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let report = s.stop().await;
    assert!(!report.cut, "nothing was running at shutdown");
    assert!(report.connections >= 1);
}

#[tokio::test]
async fn a_client_that_half_closes_while_queued_costs_nothing() {
    // The scope's one slot is taken by a slow call; the half-closing client's call
    // waits for it, sees the client end its side, and never reaches the upstream.
    let m = mock(Behavior {
        ttft_ms: 60_000.0,
        ..Behavior::text(&["slow"])
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig {
            max_calls_per_scope: 1,
            ..ProxyConfig::default()
        },
        limits(),
    )
    .await;
    let mut holder = TcpStream::connect(s.addr).await.unwrap();
    holder
        .write_all(&post("/v1/chat/completions", &chat_body("llm", false), ""))
        .await
        .unwrap();
    eventually("the slot holder reached the upstream", || {
        m.requests().len() == 1
    })
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(&post("/v1/chat/completions", &chat_body("llm", false), ""))
        .await
        .unwrap();
    c.shutdown().await.unwrap();
    let r = parse_raw(&read_to_close(&mut c).await);
    assert_openai_error(&r, 499, "client_closed_request");
    assert_eq!(
        m.requests().len(),
        1,
        "no upstream request for the half-closed client"
    );
    drop(holder);
}

#[tokio::test]
async fn a_client_that_half_closes_during_its_call_cancels_it() {
    let m = mock(Behavior {
        ttft_ms: 60_000.0,
        ..Behavior::text(&["slow"])
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    for stream in [false, true] {
        m.reset_log();
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(&post("/v1/chat/completions", &chat_body("llm", stream), ""))
            .await
            .unwrap();
        eventually("the call reached the upstream", || m.requests().len() == 1).await;
        c.shutdown().await.unwrap();
        let r = parse_raw(&read_to_close(&mut c).await);
        assert_openai_error(&r, 499, "client_closed_request");
        let ended = m.wait_for_ended(1, Duration::from_secs(10)).await;
        assert_eq!(
            ended[0].end,
            EndKind::ClientDisconnected,
            "the attempt was cancelled"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_end_of_the_grace_period_cuts_streams_with_an_error_event() {
    // A stream that stalls after its first chunk, and a plain call that never ends.
    let m = mock(Behavior {
        chunk_count: Some(3),
        stalls: vec![Stall {
            before_chunk: 1,
            ms: 600_000.0,
        }],
        ..Behavior::default()
    })
    .await;
    let llm = scope_with("LLM", ScopeKind::Chat, vec![source("a", &m)], None, |s| {
        s.stream.resume = polygw::core::resume::ResumeSetting::Off;
    })
    .await;
    let mut s = serve_with(
        vec![llm],
        ProxyConfig::default(),
        ServerLimits {
            grace: Duration::from_secs(3),
            ..limits()
        },
    )
    .await;
    let mut stream = TcpStream::connect(s.addr).await.unwrap();
    stream
        .write_all(&post("/v1/chat/completions", &chat_body("llm", true), ""))
        .await
        .unwrap();
    // Read up to the first chunk.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let started = Instant::now();
    let server = s.begin_stop();
    got.extend(read_to_close(&mut stream).await);
    let text = String::from_utf8_lossy(&got);
    assert!(started.elapsed() >= Duration::from_secs(3));
    // The last event (the body is chunked: the event is one chunk of it).
    let at = text.rfind("data: ").unwrap();
    let last = text[at + 6..].split("\n\n").next().unwrap();
    let ev: Value = serde_json::from_str(last).unwrap_or_else(|_| panic!("{text}"));
    assert_eq!(ev["error"]["code"], "server_shutdown", "{text}");
    assert!(!text.contains("[DONE]"));
    let report = server.await.unwrap().unwrap();
    assert!(report.cut);
    let ended = m.wait_for_ended(1, Duration::from_secs(10)).await;
    assert_eq!(
        ended[0].end,
        EndKind::ClientDisconnected,
        "the call was cancelled"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_does_not_read_its_answer_is_dropped() {
    // 12 MiB of answer; the client reads the first bytes and stops.
    let big = json!({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "z".repeat(12 * 1024 * 1024)}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
    let m = mock(Behavior {
        raw_body: Some(big.to_string()),
        ..Behavior::default()
    })
    .await;
    let s = serve_with(
        vec![chat_scope("LLM", &m).await],
        ProxyConfig::default(),
        ServerLimits {
            idle_timeout: Duration::from_secs(30),
            ..limits()
        },
    )
    .await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(&post("/v1/chat/completions", &chat_body("llm", false), ""))
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    assert!(c.read(&mut buf).await.unwrap() > 0);
    let url = format!("{}/metrics", s.base);
    let started = Instant::now();
    loop {
        let t = http().get(&url).send().await.unwrap().text().await.unwrap();
        if t.contains("polygw_proxy_connections_closed_total{reason=\"write_stalled\"} 1") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "{t}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        started.elapsed() >= Duration::from_secs(29),
        "{:?}",
        started.elapsed()
    );
    drop(c);
}

#[tokio::test]
async fn an_upstream_error_echoing_part_of_the_key_does_not_reach_the_client() {
    let fragment = &UPSTREAM_KEY[3..17]; // "upstream-secre"
    let m = mock(Behavior {
        error_message: Some(format!(
            "Incorrect API key provided: {fragment}*******. See docs."
        )),
        ..Behavior::status(400)
    })
    .await;
    let s = serve(vec![chat_scope("LLM", &m).await]).await;
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(!text.contains(fragment), "{text}");
    assert!(
        text.contains("Incorrect API key provided: <redacted>"),
        "{text}"
    );
}

#[tokio::test]
async fn a_secret_in_the_base_url_query_keeps_the_request_path() {
    let m = mock(Behavior::text(&["fine"])).await;
    let src = polygw::SourceConfig::new(
        "q",
        0,
        format!("{}?key=query-secret-value", m.base_url()),
        UPSTREAM_KEY,
        "model-q",
    );
    let llm = scope_with("LLM", ScopeKind::Chat, vec![src], None, |_| {}).await;
    let s = serve(vec![llm]).await;
    let r = http()
        .post(format!("{}/chat/completions", s.v1()))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.requests()[0].path, "/v1/chat/completions");
    let health = http()
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!health.contains("query-secret-value"), "{health}");
}

#[tokio::test]
async fn a_router_mounted_in_another_service_works_without_the_server() {
    let m = mock(Behavior::text(&["mounted"])).await;
    let proxy = Proxy::new(ProxyConfig::default(), vec![chat_scope("LLM", &m).await]);
    let app = axum::Router::new()
        .route("/status", axum::routing::get(|| async { "service ok" }))
        .merge(proxy.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let base = format!("http://{addr}");
    assert_eq!(
        http()
            .get(format!("{base}/status"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "service ok"
    );
    let v: Value = http()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "mounted");
    server.abort();
}
