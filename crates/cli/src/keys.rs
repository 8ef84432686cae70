//! `polygw keys create|list|revoke|rotate|set` (SPEC §21.1): client keys in the key store
//! — the `polygw_client_keys` table of a telemetry database (SQLite or PostgreSQL), named
//! by `--db` or `POLYGW_KEYS_DB` (the same variable `polygw serve` reads). A key is shown
//! once, when it is created or rotated; the table keeps its SHA-256 only.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use polygw::core::client_key::{format_nanos, parse_budget, BudgetPeriod, ClientKey, KeyLimits};
use polygw::core::ports::ClientKeyStore;
use polygw::core::secret::redact_url;
use polygw::telemetry::SqlKeyStore;

use crate::table::Table;

/// The environment variable naming the key store (`polygw keys`, `polygw serve`).
pub const KEYS_DB_VAR: &str = "POLYGW_KEYS_DB";

/// `polygw keys …`.
#[derive(Debug, clap::Args)]
pub struct KeysArgs {
    /// The key store's database URL (`sqlite://…` or `postgres://…`); default
    /// `POLYGW_KEYS_DB`.
    #[arg(long, global = true)]
    pub db: Option<String>,
    #[command(subcommand)]
    pub command: KeysCommand,
}

/// The subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Create a key and print it (once).
    Create(CreateArgs),
    /// List the keys (never the keys themselves: id, name, prefix, limits).
    List,
    /// Revoke a key (by id or name): every replica refuses it within a few seconds.
    Revoke {
        /// The key's id or name.
        key: String,
    },
    /// Give a key a new secret (its id, name and limits stay); prints it once. The old
    /// secret stops working.
    Rotate {
        /// The key's id or name.
        key: String,
    },
    /// Change a key's scopes, models, limits or budgets.
    Set(SetArgs),
}

/// Limits and budgets given on the command line.
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// Scopes the key may call (repeat or comma-separate; default all).
    #[arg(long, value_delimiter = ',')]
    pub scope: Vec<String>,
    /// Models the key may ask for (repeat or comma-separate; default all of its scopes).
    #[arg(long, value_delimiter = ',')]
    pub model: Vec<String>,
    /// Requests per minute (0 = unlimited).
    #[arg(long)]
    pub rpm: Option<u32>,
    /// Tokens per minute (0 = unlimited).
    #[arg(long)]
    pub tpm: Option<u64>,
    /// Calls in flight (0 = unlimited).
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// A spend budget, `AMOUNT/day` or `AMOUNT/month` in the prices' currency (repeat for
    /// both); `none/day`, `none/month` removes one.
    #[arg(long)]
    pub budget: Vec<String>,
}

/// `polygw keys create`.
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// A name for people (unique).
    #[arg(long)]
    pub name: String,
    #[command(flatten)]
    pub limits: LimitArgs,
}

/// `polygw keys set`.
#[derive(Debug, clap::Args)]
pub struct SetArgs {
    /// The key's id or name.
    pub key: String,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Allow every scope again.
    #[arg(long)]
    pub all_scopes: bool,
    /// Allow every model again.
    #[arg(long)]
    pub all_models: bool,
}

fn now_ms() -> i64 {
    #[allow(
        clippy::disallowed_methods,
        reason = "the CLI's wall clock: key timestamps"
    )]
    let now = std::time::SystemTime::now();
    now.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The key store's URL: `--db`, else `POLYGW_KEYS_DB`.
pub fn store_url(db: Option<&str>) -> Result<String> {
    match db {
        Some(u) => Ok(u.to_string()),
        None => std::env::var(KEYS_DB_VAR).map_err(|_| {
            anyhow!(
                "no key store: pass --db URL or set {KEYS_DB_VAR} (a telemetry database, \
                 sqlite://… or postgres://…)"
            )
        }),
    }
}

/// Applies the command line's limits to `limits` (only what was given).
fn apply(l: &LimitArgs, limits: &mut KeyLimits) -> Result<()> {
    if let Some(x) = l.rpm {
        limits.rpm = x;
    }
    if let Some(x) = l.tpm {
        limits.tpm = x;
    }
    if let Some(x) = l.concurrency {
        limits.max_concurrency = x;
    }
    for b in &l.budget {
        let t = b.trim().to_ascii_lowercase();
        if let Some(period) = t.strip_prefix("none/") {
            match period {
                "day" | "d" => limits.budget_day_nanos = None,
                "month" | "m" | "mo" => limits.budget_month_nanos = None,
                other => bail!("--budget {b:?}: the period {other:?} is neither day nor month"),
            }
            continue;
        }
        let (period, nanos) = parse_budget(b).map_err(|e| anyhow!("--budget: {e}"))?;
        match period {
            BudgetPeriod::Day => limits.budget_day_nanos = Some(nanos),
            BudgetPeriod::Month => limits.budget_month_nanos = Some(nanos),
        }
    }
    Ok(())
}

fn names(v: &[String]) -> Vec<String> {
    v.iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

async fn find(store: &SqlKeyStore, key: &str) -> Result<ClientKey> {
    store
        .find(key)
        .await?
        .ok_or_else(|| anyhow!("no client key with id or name {key:?}"))
}

fn show_limits(k: &ClientKey) -> String {
    let l = &k.limits;
    let mut parts = Vec::new();
    let n = |x: u64| {
        if x == 0 {
            "∞".to_string()
        } else {
            x.to_string()
        }
    };
    parts.push(format!("rpm {}", n(u64::from(l.rpm))));
    parts.push(format!("tpm {}", n(l.tpm)));
    parts.push(format!("concurrency {}", n(u64::from(l.max_concurrency))));
    if let Some(b) = l.budget_day_nanos {
        parts.push(format!("{}/day", format_nanos(b)));
    }
    if let Some(b) = l.budget_month_nanos {
        parts.push(format!("{}/month", format_nanos(b)));
    }
    parts.join(", ")
}

fn printed_once(key: &str, k: &ClientKey) {
    println!("{key}");
    eprintln!(
        "client key {} ({}): shown once — store it now; polygw keeps only its hash",
        k.id, k.name
    );
}

/// Runs `polygw keys …`.
pub async fn run(args: KeysArgs) -> Result<ExitCode> {
    let url = match store_url(args.db.as_deref()) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let store = SqlKeyStore::connect(&url, Duration::from_secs(10))
        .await
        .with_context(|| format!("opening the key store {}", redact_url(&url)))?;
    let r = match args.command {
        KeysCommand::Create(a) => create(&store, a).await,
        KeysCommand::List => list(&store).await,
        KeysCommand::Revoke { key } => revoke(&store, &key).await,
        KeysCommand::Rotate { key } => rotate(&store, &key).await,
        KeysCommand::Set(a) => set(&store, a).await,
    };
    store.close().await;
    match r {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e:#}");
            Ok(ExitCode::from(1))
        }
    }
}

async fn create(store: &SqlKeyStore, a: CreateArgs) -> Result<()> {
    let name = a.name.trim().to_string();
    if name.is_empty() {
        bail!("--name must not be empty");
    }
    let mut limits = KeyLimits::default();
    apply(&a.limits, &mut limits)?;
    let new = polygw::client_keys::generate_key().map_err(|e| anyhow!(e))?;
    let now = now_ms();
    let k = ClientKey {
        id: polygw::client_keys::new_key_id(),
        name,
        hash: new.hash,
        prefix: new.prefix,
        scopes: names(&a.limits.scope),
        models: names(&a.limits.model),
        limits,
        created_at_ms: now,
        updated_at_ms: now,
        revoked_at_ms: None,
    };
    store.create(k.clone()).await?;
    printed_once(&new.key, &k);
    Ok(())
}

async fn list(store: &SqlKeyStore) -> Result<()> {
    let keys = store.list().await?;
    if keys.is_empty() {
        println!("no client keys");
        return Ok(());
    }
    let mut t = Table::new(["id", "name", "key", "scopes", "models", "limits", "state"]);
    for k in &keys {
        let all = |v: &[String]| {
            if v.is_empty() {
                "all".to_string()
            } else {
                v.join(",")
            }
        };
        let state = match k.revoked_at_ms {
            Some(ms) => format!("revoked {}", polygw::telemetry::format_utc_ms(ms)),
            None => "valid".to_string(),
        };
        t.row([
            k.id.as_str(),
            k.name.as_str(),
            &format!("{}…", k.prefix),
            &all(&k.scopes),
            &all(&k.models),
            &show_limits(k),
            &state,
        ]);
    }
    print!("{}", t.render());
    Ok(())
}

async fn revoke(store: &SqlKeyStore, key: &str) -> Result<()> {
    let mut k = find(store, key).await?;
    if k.revoked_at_ms.is_some() {
        println!("client key {} ({}) was revoked already", k.id, k.name);
        return Ok(());
    }
    let now = now_ms();
    k.revoked_at_ms = Some(now);
    k.updated_at_ms = now;
    store.update(k.clone()).await?;
    println!(
        "client key {} ({}) revoked: every polygw serve refuses it within a few seconds",
        k.id, k.name
    );
    Ok(())
}

async fn rotate(store: &SqlKeyStore, key: &str) -> Result<()> {
    let mut k = find(store, key).await?;
    if k.revoked_at_ms.is_some() {
        bail!(
            "client key {} ({}) is revoked: create a new one",
            k.id,
            k.name
        );
    }
    let new = polygw::client_keys::generate_key().map_err(|e| anyhow!(e))?;
    k.hash = new.hash;
    k.prefix = new.prefix;
    k.updated_at_ms = now_ms();
    store.update(k.clone()).await?;
    printed_once(&new.key, &k);
    Ok(())
}

async fn set(store: &SqlKeyStore, a: SetArgs) -> Result<()> {
    let mut k = find(store, &a.key).await?;
    apply(&a.limits, &mut k.limits)?;
    if a.all_scopes {
        k.scopes.clear();
    } else if !a.limits.scope.is_empty() {
        k.scopes = names(&a.limits.scope);
    }
    if a.all_models {
        k.models.clear();
    } else if !a.limits.model.is_empty() {
        k.models = names(&a.limits.model);
    }
    k.updated_at_ms = now_ms();
    store.update(k.clone()).await?;
    println!("client key {} ({}): {}", k.id, k.name, show_limits(&k));
    Ok(())
}
