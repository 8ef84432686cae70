//! What every client type of a scope offers the same way: loading from the environment
//! (or any key/value source) or from settings, a builder, its settings and warnings,
//! and shutdown.

/// Implements the common constructors and accessors of a client of `$kind`, built by
/// `GatewayBuilder::$build`.
macro_rules! scope_client {
    ($ty:ident, $kind:expr, $build:ident) => {
        impl $ty {
            /// Loads scope `scope` from the process environment (SPEC §2) and builds it.
            /// Variables that are not UTF-8 are skipped, or reported when they belong
            /// to the scope ([`crate::process_vars`]).
            pub async fn from_env(scope: &str) -> Result<Self, polygw_core::GatewayError> {
                Self::from_vars(crate::process_vars(Some(scope))?, scope).await
            }

            /// Loads scope `scope` from any key/value source and builds it.
            pub async fn from_vars<I, K, V>(
                vars: I,
                scope: &str,
            ) -> Result<Self, polygw_core::GatewayError>
            where
                I: IntoIterator<Item = (K, V)>,
                K: AsRef<str>,
                V: AsRef<str>,
            {
                let loaded = polygw_core::config::load_scope(vars, scope, $kind)?;
                Self::builder(loaded.settings).$build().await
            }

            /// Builds a client from settings made in code (or loaded and edited).
            pub async fn from_settings(
                settings: polygw_core::ScopeSettings,
            ) -> Result<Self, polygw_core::GatewayError> {
                Self::builder(settings).$build().await
            }

            /// A builder over these settings: give it any port implementation; the
            /// ports not given are built from the settings.
            pub fn builder(settings: polygw_core::ScopeSettings) -> crate::GatewayBuilder {
                crate::GatewayBuilder::new(settings).kind($kind)
            }

            /// The scope's settings.
            pub fn settings(&self) -> &polygw_core::ScopeSettings {
                &self.engine.scope
            }

            /// What the configuration guards warned about.
            pub fn warnings(&self) -> &[polygw_core::ConfigWarning] {
                &self.warnings
            }

            /// Flushes background settlements and telemetry; call on shutdown.
            pub async fn shutdown(&self) -> polygw_core::ports::FlushReport {
                self.engine.shutdown().await
            }

            /// Whether the scope's governance backend answers now (readiness, SPEC
            /// §21.2): Redis — one round trip to where the scope's keys live (bounded
            /// by its operation timeout); in memory — always `Ok`. Errors name the
            /// backend with its password redacted.
            pub async fn check_governance(&self) -> Result<(), polygw_core::GovernanceError> {
                self.engine
                    .ports
                    .limiter
                    .ping(&self.engine.scope.name)
                    .await
            }

            /// The scope's telemetry recorder (shared by the clients built with it;
            /// `NullRecorder` when telemetry is off): for readiness checks
            /// (`check_writable`) made once per database.
            pub fn telemetry_recorder(
                &self,
            ) -> std::sync::Arc<dyn polygw_core::ports::TelemetryRecorder> {
                self.engine.ports.telemetry.clone()
            }
        }
    };
}

pub(crate) use scope_client;
