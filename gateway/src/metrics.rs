//! The gateway's Prometheus metrics, served at `/metrics` on its own address.

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};

/// Every collector.
pub struct Metrics {
    /// Where they are registered.
    pub registry: Registry,
    /// `sandcell_gateway_requests_total{route, status}`: every request answered, by matched route.
    pub requests: IntCounterVec,
    /// `sandcell_gateway_request_seconds{route}`: until the response's head (a stream's body
    /// goes on after it).
    pub request_seconds: HistogramVec,
    /// `sandcell_gateway_auth_refused_total{why}`: `no_key`, `bad_key`, `bad_sandbox_token`.
    pub auth_refused: IntCounterVec,
    /// `sandcell_gateway_runs_total{status}`: runs (code and commands) by the job's end status,
    /// or `no_result`.
    pub runs: IntCounterVec,
    /// `sandcell_gateway_run_seconds`: a run from its request to its stream's last line.
    pub run_seconds: Histogram,
    /// `sandcell_gateway_client_gone_total`: runs whose client went away before their end (the
    /// job was cancelled).
    pub client_gone: IntCounter,
    /// `sandcell_gateway_responses_abandoned_total{why}`: streamed answers abandoned because
    /// their client did not read them: `over_budget` (a live line would have taken the tenant
    /// past `SANDCELL_GATEWAY_UNREAD_BYTES`) or `stalled` (nothing read for
    /// `SANDCELL_GATEWAY_STALL_S`).
    pub abandoned: IntCounterVec,
}

impl Metrics {
    /// Create and register the collectors.
    pub fn new() -> anyhow::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(Opts::new("sandcell_gateway_requests_total", "Requests answered, by route and status."), &["route", "status"])?;
        let buckets = vec![0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0];
        let request_seconds = HistogramVec::new(
            HistogramOpts::new("sandcell_gateway_request_seconds", "Time to a response's head, by route.").buckets(buckets.clone()),
            &["route"],
        )?;
        let auth_refused = IntCounterVec::new(Opts::new("sandcell_gateway_auth_refused_total", "Requests refused for their credentials, by why."), &["why"])?;
        let runs = IntCounterVec::new(Opts::new("sandcell_gateway_runs_total", "Runs (code, commands) by the job's end status."), &["status"])?;
        let run_seconds =
            Histogram::with_opts(HistogramOpts::new("sandcell_gateway_run_seconds", "A run from request to its stream's last line.").buckets(buckets))?;
        let client_gone = IntCounter::new("sandcell_gateway_client_gone_total", "Runs whose client went away before their end (cancelled).")?;
        registry.register(Box::new(client_gone.clone()))?;
        let abandoned = IntCounterVec::new(
            Opts::new("sandcell_gateway_responses_abandoned_total", "Streamed answers abandoned because their client did not read them, by why."),
            &["why"],
        )?;
        for why in ["over_budget", "stalled"] {
            abandoned.with_label_values(&[why]);
        }
        registry.register(Box::new(abandoned.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(request_seconds.clone()))?;
        registry.register(Box::new(auth_refused.clone()))?;
        registry.register(Box::new(runs.clone()))?;
        registry.register(Box::new(run_seconds.clone()))?;
        Ok(Metrics { registry, requests, request_seconds, auth_refused, runs, run_seconds, client_gone, abandoned })
    }
}
