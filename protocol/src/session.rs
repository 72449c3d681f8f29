//! Sessions: the contract of a stateful kernel that lives across jobs.
//!
//! A session is one long-lived sandbox on one worker. A job opens it (`session.new`), later jobs
//! name it (`session.id`) and run in it one at a time, in submission order, seeing the variables
//! and files earlier jobs left. It ends when its keep-alive runs out, when a job closes it, or
//! when its worker dies. This module owns the session state machine and the keep-alive rules.
//!
//! ```text
//! new job ──▶ starting ──▶ active ──▶ expired   (keep-alive ran out)
//!                │          │  ▲  ├──▶ closed    (a job asked `close`)
//!                │          │  │  └──▶ lost      (the kernel could not restart)
//!                │          ▼  │
//!                │         moving ──▶ lost | expired   (no worker took it over / nobody used it)
//!                └──▶ failed  (no sandbox could be started for it)
//! ```
//!
//! `moving`: its worker died or drained; its next job re-opens it on another worker from its
//! stored workspace (and, after a drain, its variables), then it is `active` there again.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{ErrorCode, Reason};

/// Where a session is in its life. Terminal states never change again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Recorded by the scheduler; its first job has not reached a worker yet.
    Starting,
    /// Held by a worker, which runs its jobs.
    Active,
    /// Its worker died or drained; its next job takes it over on another worker.
    Moving,
    /// The keep-alive ran out; container and workspace are gone.
    Expired,
    /// A job closed it; container and workspace are gone.
    Closed,
    /// Its worker died or its kernel could not be restarted.
    Lost,
    /// No sandbox could be started for it.
    Failed,
}

impl SessionState {
    /// Every state.
    pub const ALL: [SessionState; 7] = [
        SessionState::Starting,
        SessionState::Active,
        SessionState::Moving,
        SessionState::Expired,
        SessionState::Closed,
        SessionState::Lost,
        SessionState::Failed,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Starting => "starting",
            SessionState::Active => "active",
            SessionState::Moving => "moving",
            SessionState::Expired => "expired",
            SessionState::Closed => "closed",
            SessionState::Lost => "lost",
            SessionState::Failed => "failed",
        }
    }

    /// Parse a wire name.
    pub fn parse(s: &str) -> Option<SessionState> {
        SessionState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether the session can never run a job again.
    pub fn is_terminal(self) -> bool {
        !matches!(self, SessionState::Starting | SessionState::Active | SessionState::Moving)
    }

    /// Whether `self → next` is a legal transition.
    pub fn can_become(self, next: SessionState) -> bool {
        use SessionState::*;
        match (self, next) {
            (Starting, Active | Failed | Lost) => true,
            // The first job was redelivered to another worker after its worker died.
            (Active, Active) => true,
            (Active, Expired | Closed | Lost) => true,
            // Its worker died or drained; another worker takes it over with its next job.
            (Active, Moving) | (Moving, Active) => true,
            // Nobody took it over in time, or nobody used it before its keep-alive ran out.
            (Moving, Lost | Expired | Closed) => true,
            _ => false,
        }
    }

    /// The states from which `next` may be entered (for SQL guards).
    pub fn sources_of(next: SessionState) -> Vec<SessionState> {
        SessionState::ALL.into_iter().filter(|s| s.can_become(next)).collect()
    }

    /// Why a job naming a session in this state cannot run, if it cannot.
    pub fn refusal(self, id: &str) -> Option<Reason> {
        let (code, what) = match self {
            // Its jobs wait for the worker that takes it over.
            SessionState::Active | SessionState::Moving => return None,
            SessionState::Starting => (ErrorCode::SessionNotReady, "is still starting; submit again once its first job is running"),
            SessionState::Expired => (ErrorCode::SessionExpired, "expired: its keep-alive ran out and its state is gone"),
            SessionState::Closed => (ErrorCode::SessionClosed, "was closed"),
            SessionState::Lost => (ErrorCode::SessionLost, "was lost with its worker; its state is gone"),
            SessionState::Failed => (ErrorCode::SessionLost, "never started"),
        };
        Some(Reason::new(code, format!("session {id} {what}")))
    }
}

impl std::fmt::Display for SessionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The session part of a submission: open a new session, or run in an existing one.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRequest {
    /// `true`: open a new session with this job; the result carries its id.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub new: bool,
    /// Run in this existing session (an id a previous result returned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Seconds the session lives after its last activity (default 300; clamped to `[1, the
    /// operator's maximum]`, 3600 by default). With `new`: the session's keep-alive; with `id`:
    /// its new keep-alive from this job on (E2B's `set_timeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive_s: Option<u64>,
    /// With `id`: close the session after this job (its code may be empty).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub close: bool,
}

impl SessionRequest {
    /// Check the combination of fields; returns a message for `invalid_value`.
    pub fn check(&self) -> Result<(), String> {
        match (&self.id, self.new) {
            (Some(_), true) => return Err("session: give either `new: true` or `id`, not both".into()),
            (None, false) => return Err("session: give `new: true` to open a session or `id` to use one".into()),
            (Some(id), false) if !is_valid_session_id(id) => return Err("session.id is not a session id sandcell issued".into()),
            _ => {}
        }
        if self.close && self.new {
            return Err("session.close needs an existing session `id`".into());
        }
        Ok(())
    }
}

/// Session ids are issued by the scheduler: `ses_` and 32 lowercase hex digits.
pub fn new_session_id() -> String {
    format!("ses_{}", uuid::Uuid::new_v4().simple())
}

/// Whether `s` has the shape of an id sandcell issues.
pub fn is_valid_session_id(s: &str) -> bool {
    s.len() == 36 && s.starts_with("ses_") && s[4..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The operator's keep-alive rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlivePolicy {
    /// Used when the job asks for none (`SANDCELL_SESSION_KEEP_ALIVE_S`, default 300).
    pub default_s: u64,
    /// The most a job may ask for (`SANDCELL_SESSION_MAX_KEEP_ALIVE_S`, default 3600).
    pub max_s: u64,
}

impl Default for KeepAlivePolicy {
    fn default() -> Self {
        KeepAlivePolicy { default_s: 300, max_s: 3600 }
    }
}

impl KeepAlivePolicy {
    /// The keep-alive a session gets: the request clamped to `[1, max]`, or the default.
    pub fn resolve(&self, requested: Option<u64>) -> u64 {
        requested.unwrap_or(self.default_s).clamp(1, self.max_s.max(1))
    }
}

/// What the scheduler tells a worker about the session of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSession {
    /// The session id.
    pub id: String,
    /// This job opens the session.
    pub new: bool,
    /// The keep-alive in seconds, resolved by the scheduler: with `new`, the session's; else
    /// its new keep-alive from this job on, or 0 for unchanged.
    pub keep_alive_s: u64,
    /// Close the session after this job.
    pub close: bool,
    /// This job takes the session over from the worker that held it (the scheduler sends it
    /// on the new-sessions queue); later jobs wait until it is bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopt: Option<Adoption>,
}

/// Why and from where a job takes a session over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Adoption {
    /// The worker that held the session.
    pub from_worker: String,
    /// Why it moved.
    pub cause: MoveCause,
}

/// Why a session moved to another worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MoveCause {
    /// Its worker stopped responding (killed, crashed, cut off) or restarted.
    WorkerLost,
    /// Its worker was told to stop and drained.
    Drained,
}

impl MoveCause {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            MoveCause::WorkerLost => "worker_lost",
            MoveCause::Drained => "drained",
        }
    }

    /// Parse a wire name.
    pub fn parse(s: &str) -> Option<MoveCause> {
        [MoveCause::WorkerLost, MoveCause::Drained].into_iter().find(|c| c.as_str() == s)
    }
}

/// In the result of the job that took a session over: where it came from and what it kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionMove {
    /// The worker that held the session before.
    pub from_worker: String,
    /// Why it moved.
    pub cause: MoveCause,
    /// Workspace files put back from the store before this job ran.
    pub files_restored: u32,
    /// Files of the workspace that could not be put back (expired, never stored, unreadable).
    pub files_missing: Vec<String>,
    /// True when the session's variables came along (a drain serialized them).
    pub variables_restored: bool,
    /// Variables that could not be carried (not serializable). When the worker died, nothing
    /// was carried and this is `["*"]`: every variable, import and open object is gone.
    pub variables_lost: Vec<String>,
}
/// A session as a client reads it (in a job result, or on its own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Session {
    /// The session id.
    pub id: String,
    /// Owner.
    pub tenant: String,
    /// Where the session is.
    pub state: SessionState,
    /// Seconds of inactivity before it expires.
    pub keep_alive_s: i64,
    /// The worker holding it (while starting: none yet).
    pub worker_id: Option<String>,
    /// When the scheduler recorded it.
    pub created_at: DateTime<Utc>,
    /// When a job last finished in it (or it became active).
    pub last_activity_at: Option<DateTime<Utc>>,
    /// When it expires unless a job runs first (active sessions only).
    pub expires_at: Option<DateTime<Utc>>,
    /// When it ended.
    pub ended_at: Option<DateTime<Utc>>,
    /// Why it ended, for `lost` and `failed`.
    pub end_reason: Option<Reason>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_never_change() {
        for from in SessionState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in SessionState::ALL {
                assert!(!from.can_become(to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn only_an_active_or_moving_session_takes_jobs() {
        for s in SessionState::ALL {
            assert_eq!(s.refusal("ses_x").is_none(), matches!(s, SessionState::Active | SessionState::Moving), "{s}");
        }
        assert_eq!(SessionState::Expired.refusal("ses_x").unwrap().code, ErrorCode::SessionExpired);
    }

    #[test]
    fn a_moving_session_is_taken_over_or_ends_and_only_an_active_one_moves() {
        use SessionState::*;
        assert!(Active.can_become(Moving) && Moving.can_become(Active));
        assert!(Moving.can_become(Lost) && Moving.can_become(Expired) && Moving.can_become(Closed));
        assert!(!Starting.can_become(Moving) && !Moving.can_become(Starting) && !Moving.can_become(Failed));
        assert_eq!(SessionState::sources_of(Moving), vec![Active]);
        assert_eq!(MoveCause::parse(MoveCause::Drained.as_str()), Some(MoveCause::Drained));
    }

    #[test]
    fn issued_ids_are_valid_and_others_are_not() {
        assert!(is_valid_session_id(&new_session_id()));
        for bad in ["", "ses_", "ses_../../etc", "SES_0123456789abcdef0123456789abcdef", "ses_0123456789ABCDEF0123456789abcdef"] {
            assert!(!is_valid_session_id(bad), "{bad}");
        }
    }

    #[test]
    fn keep_alive_is_clamped_to_the_operator_maximum() {
        let p = KeepAlivePolicy::default();
        assert_eq!(p.resolve(None), 300);
        assert_eq!(p.resolve(Some(99_999)), 3600);
        assert_eq!(p.resolve(Some(0)), 1);
    }

    #[test]
    fn session_request_combinations() {
        let new = SessionRequest { new: true, ..Default::default() };
        assert!(new.check().is_ok());
        let id = SessionRequest { id: Some(new_session_id()), close: true, ..Default::default() };
        assert!(id.check().is_ok());
        assert!(SessionRequest::default().check().is_err());
        assert!(SessionRequest { new: true, id: Some(new_session_id()), ..Default::default() }.check().is_err());
        // A new keep-alive for an existing session (set_timeout).
        assert!(SessionRequest { id: Some(new_session_id()), keep_alive_s: Some(5), ..Default::default() }.check().is_ok());
        assert!(SessionRequest { new: true, close: true, ..Default::default() }.check().is_err());
    }
}
