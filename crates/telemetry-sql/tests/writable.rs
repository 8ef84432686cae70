//! `TelemetryRecorder::check_writable` (readiness, SPEC §21.2): a database the recorder
//! can write to passes — SQLite, and PostgreSQL when it is reachable (always under CI) —
//! and a recorder that has stopped does not.

use polygw_telemetry_sql::{RecorderConfig, SqlRecorder, TelemetryRecorder};

#[tokio::test]
async fn sqlite_is_writable_until_the_recorder_stops() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    let rec = SqlRecorder::connect(&url, RecorderConfig::default())
        .await
        .unwrap();
    rec.check_writable().await.unwrap();
    // Twice: the check leaves no transaction open on the one connection.
    rec.check_writable().await.unwrap();
    rec.flush().await.unwrap();
    rec.shutdown().await;
    let e = rec.check_writable().await.unwrap_err();
    assert!(e.to_string().contains("has stopped"), "{e}");
}

#[tokio::test]
async fn postgres_is_writable() {
    let Some(url) = polygw_testkit::services::postgres_url() else {
        return;
    };
    let rec = SqlRecorder::connect(&url, RecorderConfig::default())
        .await
        .unwrap();
    rec.check_writable().await.unwrap();
    rec.shutdown().await;
}
