//! What the intake remembers of a tenant found at a quota, so that a flood past it is refused
//! without judging each submission again under the tenant's lock.
//!
//! Why: judging a submission takes the tenant's row lock (`sandcell_record_job`), so one
//! tenant's submissions are judged one after another, ~4 ms each on the local stack. A tenant
//! publishing faster than that (3,000 one-off jobs past its quota in 0.9 s) filled every intake
//! partition's prefetch window with submissions waiting for its lock, and every other tenant's
//! submission waited behind them in the partition queues: another tenant's `6*7` took 10.5 s
//! instead of 80 ms. A refusal takes no lock, so the tenant's submissions that are refused
//! from memory are recorded side by side (its `SANDCELL_INTAKE_TENANT_CONCURRENCY` places) and
//! its flood leaves the partitions several times sooner.
//!
//! A flood into one session lands in one partition and waited in its session's lane, judged
//! one look and one write after another (3,000 jobs: another tenant's job in that partition
//! 8.1 s behind them). A session's job refused from memory takes no turn in the lane
//! (`intake::take`): 0.9 s. Its refusal then stands, so that it never reorders the session.
//!
//! The cost: for `SANDCELL_INTAKE_QUOTA_MEMORY_MS` after a refusal, a submission of the same
//! kind is refused with the figures of that look, although a job of the tenant may have ended
//! meanwhile. Each new look, once the memory has lapsed, refreshes it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandcell_protocol::{Reason, Submission};

/// The default of `SANDCELL_INTAKE_QUOTA_MEMORY_MS`.
pub const DEFAULT_QUOTA_MEMORY: Duration = Duration::from_millis(200);

/// Which quotas a submission is judged by: a job that opens a session is subject to the
/// sessions quota as well, so a refusal of one says nothing of the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A job that opens no session: one-off, or in an existing session (judged by the same
    /// quotas: queued jobs and stored bytes).
    Job,
    /// A job that opens a session.
    OpensSession,
}

/// When each tenant's submissions of a kind were last refused, and why.
type Refusals = HashMap<(String, Kind), (Instant, Reason)>;

impl Kind {
    /// The kind of `sub`, if a refusal of it may be remembered: a close is always judged (a
    /// bare one passes the stored-bytes quotas, and it frees a sandbox).
    pub fn of(sub: &Submission) -> Option<Kind> {
        match &sub.session {
            None => Some(Kind::Job),
            Some(req) if req.new => Some(Kind::OpensSession),
            Some(req) if req.close => None,
            Some(_) => Some(Kind::Job),
        }
    }
}

/// Refusals remembered per tenant and [`Kind`], each for the memory's span.
#[derive(Debug, Clone)]
pub struct QuotaMemory {
    span: Duration,
    refused: Arc<Mutex<Refusals>>,
}

impl QuotaMemory {
    /// A memory keeping each refusal for `span` (zero: none is kept).
    pub fn new(span: Duration) -> QuotaMemory {
        QuotaMemory { span, refused: Arc::default() }
    }

    /// The refusal of `tenant`'s submissions of `kind` looked at less than the span ago, if any.
    pub fn recall(&self, tenant: &str, kind: Kind) -> Option<Reason> {
        self.recall_at(tenant, kind, Instant::now())
    }

    /// Remember that `tenant`'s submission of `kind` was refused for `reason` just now.
    pub fn remember(&self, tenant: &str, kind: Kind, reason: &Reason) {
        self.remember_at(tenant, kind, reason, Instant::now());
    }

    fn recall_at(&self, tenant: &str, kind: Kind, now: Instant) -> Option<Reason> {
        let refused = self.refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (at, reason) = refused.get(&(tenant.to_owned(), kind))?;
        (now.saturating_duration_since(*at) < self.span).then(|| reason.clone())
    }

    fn remember_at(&self, tenant: &str, kind: Kind, reason: &Reason, now: Instant) {
        if self.span.is_zero() {
            return;
        }
        let mut refused = self.refused.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if refused.len() >= 1024 {
            // Bounded by the tenants refused within one span; the lapsed ones go first.
            refused.retain(|_, (at, _)| now.saturating_duration_since(*at) < self.span);
        }
        refused.insert((tenant.to_owned(), kind), (now, reason.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandcell_protocol::ErrorCode;

    fn over() -> Reason {
        Reason::new(ErrorCode::QuotaExceeded, "tenant has 4 jobs queued or running; its quota is 4")
    }

    #[test]
    fn a_sessions_job_shares_the_one_off_memory_and_a_close_is_always_judged() {
        use sandcell_protocol::{Language, SessionRequest};
        let with = |session: Option<SessionRequest>| {
            let mut sub = Submission::new("a", "job-1", Language::Python, "1");
            sub.session = session;
            Kind::of(&sub)
        };
        let existing = || SessionRequest { id: Some("s-1".into()), ..Default::default() };
        assert_eq!(with(None), Some(Kind::Job));
        assert_eq!(with(Some(SessionRequest { new: true, ..Default::default() })), Some(Kind::OpensSession));
        assert_eq!(with(Some(existing())), Some(Kind::Job));
        assert_eq!(with(Some(SessionRequest { close: true, ..existing() })), None);
    }

    #[test]
    fn a_refusal_is_recalled_for_its_span_then_forgotten() {
        let memory = QuotaMemory::new(Duration::from_millis(200));
        let t0 = Instant::now();
        memory.remember_at("a", Kind::Job, &over(), t0);
        assert_eq!(memory.recall_at("a", Kind::Job, t0 + Duration::from_millis(199)), Some(over()));
        assert_eq!(memory.recall_at("a", Kind::Job, t0 + Duration::from_millis(200)), None);
    }

    #[test]
    fn a_refusal_is_recalled_only_for_its_tenant_and_kind() {
        let memory = QuotaMemory::new(Duration::from_secs(1));
        let t0 = Instant::now();
        memory.remember_at("a", Kind::OpensSession, &over(), t0);
        assert_eq!(memory.recall_at("a", Kind::Job, t0), None);
        assert_eq!(memory.recall_at("b", Kind::OpensSession, t0), None);
        assert_eq!(memory.recall_at("a", Kind::OpensSession, t0), Some(over()));
    }

    #[test]
    fn a_zero_span_remembers_nothing() {
        let memory = QuotaMemory::new(Duration::ZERO);
        let t0 = Instant::now();
        memory.remember_at("a", Kind::Job, &over(), t0);
        assert_eq!(memory.recall_at("a", Kind::Job, t0), None);
    }

    #[test]
    fn lapsed_refusals_make_room_for_new_tenants() {
        let memory = QuotaMemory::new(Duration::from_millis(10));
        let t0 = Instant::now();
        for i in 0..1024 {
            memory.remember_at(&format!("t{i}"), Kind::Job, &over(), t0);
        }
        memory.remember_at("late", Kind::Job, &over(), t0 + Duration::from_secs(1));
        assert_eq!(memory.refused.lock().map(|r| r.len()).unwrap_or(0), 1);
    }
}
