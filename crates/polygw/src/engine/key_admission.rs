//! A call's admission against its client key (SPEC §21.1, §24.1): its reservation —
//! the prompt estimate with the scope's margin and its output cap, at the scope's
//! dearest prices — asked of the key's governance backend once; a budget that cannot
//! pay for the whole cap shrinks it to what it can pay, down to the smaller of the
//! call's own cap and `KEYS__MIN_OUTPUT_TOKENS` (the arithmetic is
//! `polygw_core::key_funds`'s).

use std::sync::{Arc, Mutex};

use polygw_core::client_key::ClientKey;
use polygw_core::error::RefusalReason;
use polygw_core::key_funds::{default_cap, shrunk_cap, CallFunds};
use polygw_core::key_quota::{key_reservation, KeyReservation, ScopePrices};
use polygw_core::ports::{KeyAcquire, KeyAdmission, KeyPermit, Refusal};
use polygw_core::ScopeKind;

use super::Engine;
use crate::client_keys::{KeyAdmitError, KeyCharge, LegFunding};

/// One admission's outcome, with what it reserved.
struct Asked {
    answer: Result<KeyPermit, Refusal>,
    reservation: KeyReservation,
    reserve: u64,
}

impl Engine {
    /// Admits a call against a client key (see `GatewayClient::admit_key`).
    pub(crate) async fn admit_key(
        &self,
        key: &ClientKey,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
    ) -> Result<Arc<KeyCharge>, KeyAdmitError> {
        if key.limits.is_unlimited() {
            return Ok(KeyCharge::unmetered(&key.id));
        }
        // A chat call of a budgeted key without a cap of its own reserves for, and is
        // sent, the scope's default cap (SPEC §24.1).
        let chat = self.kind == ScopeKind::Chat;
        let budgeted = key.limits.has_budget();
        let default =
            (chat && budgeted && max_tokens.is_none()).then(|| default_cap(&self.scope.sources));
        let mut cap = max_tokens.or(default);
        let mut send_cap = default;
        let mut asked = self.ask_key(key, prompt_tokens, cap).await?;
        if let (Err(refusal), true, Some(wanted)) = (&asked.answer, chat && budgeted, cap) {
            if let Some(shrunk) = self.shrink(key, refusal, prompt_tokens, wanted).await {
                let retry = self.ask_key(key, prompt_tokens, Some(shrunk)).await?;
                if retry.answer.is_ok() {
                    tracing::debug!(
                        key = %key.id,
                        cap = shrunk,
                        wanted,
                        "the key's remaining budget pays for a smaller output cap"
                    );
                    (cap, send_cap, asked) = (Some(shrunk), Some(shrunk), retry);
                }
            }
        }
        let Asked {
            answer,
            reservation,
            reserve,
        } = asked;
        match answer {
            Ok(p) if chat => Ok(KeyCharge::funded(
                &key.id,
                p,
                LegFunding {
                    prompt_tokens,
                    cap,
                    send_cap,
                    budgeted,
                    margin_pct: self.scope.keys.estimate_margin_pct,
                    limiter: self.ports.limiter.clone(),
                    budget_day_nanos: key.limits.budget_day_nanos,
                    budget_month_nanos: key.limits.budget_month_nanos,
                    lease: self.scope.limits.lease,
                    funds: Mutex::new(CallFunds::new(reserve)),
                    top_ups: Mutex::new(Vec::new()),
                },
            )),
            Ok(p) => Ok(KeyCharge::new(&key.id, p)),
            Err(refusal) => Err(KeyAdmitError::Refused {
                refusal,
                reserve_nanos: reserve,
                est_tokens: reservation.tokens,
            }),
        }
    }

    /// One admission of a call with output cap `cap`.
    async fn ask_key(
        &self,
        key: &ClientKey,
        prompt_tokens: u64,
        cap: Option<u64>,
    ) -> Result<Asked, KeyAdmitError> {
        let reservation = key_reservation(
            prompt_tokens,
            cap,
            self.scope.keys.estimate_margin_pct,
            &self.scope.sources,
            self.scope.limits.tpm,
        );
        let reserve = reservation
            .reserve_nanos(key.limits.has_budget())
            .map_err(|refusal| KeyAdmitError::Refused {
                refusal,
                reserve_nanos: 0,
                est_tokens: reservation.tokens,
            })?;
        let req = KeyAcquire {
            key_id: &key.id,
            rpm: key.limits.rpm,
            tpm: key.limits.tpm,
            max_concurrency: key.limits.max_concurrency,
            budget_day_nanos: key.limits.budget_day_nanos,
            budget_month_nanos: key.limits.budget_month_nanos,
            est_tokens: reservation.tokens,
            reserve_nanos: reserve,
            lease: self.scope.limits.lease,
            top_up: false,
        };
        let answer = match self.ports.limiter.acquire_key(&req).await {
            Ok(KeyAdmission::Admitted(p)) => Ok(p),
            Ok(KeyAdmission::Refused(r)) => Err(r),
            Err(e) => return Err(KeyAdmitError::Backend(e)),
        };
        Ok(Asked {
            answer,
            reservation,
            reserve,
        })
    }

    /// The smaller cap the key's remaining budget pays for after a budget refusal, if it
    /// is at least the call's floor (SPEC §24.1); `None` otherwise (the refusal stands).
    async fn shrink(
        &self,
        key: &ClientKey,
        refusal: &Refusal,
        prompt_tokens: u64,
        wanted: u64,
    ) -> Option<u64> {
        if !matches!(
            refusal.reason,
            RefusalReason::KeyBudgetDay | RefusalReason::KeyBudgetMonth
        ) {
            return None;
        }
        let usage = self.ports.limiter.key_usage(&key.id).await.ok()?;
        let left = |budget: Option<u64>, spent: u64| budget.map(|b| b.saturating_sub(spent));
        let remaining = [
            left(key.limits.budget_day_nanos, usage.day_nanos),
            left(key.limits.budget_month_nanos, usage.month_nanos),
        ]
        .into_iter()
        .flatten()
        .min()?;
        let cap = shrunk_cap(
            remaining,
            prompt_tokens,
            self.scope.keys.estimate_margin_pct,
            &ScopePrices::highest(&self.scope.sources),
            wanted,
            self.scope.keys.min_output_tokens,
        )?;
        (cap < wanted).then_some(cap)
    }
}
