//! `sandcell-admin`: operator commands. See `docs/security.md` ("Tenants").
//!
//! ```text
//! sandcell-admin tenant create acme [--max-sessions 20] [--max-queued-jobs 1000] [--max-artifact-bytes N] [--max-jobs-in-flight 4] [--max-result-bytes N] [--max-db-connections 16]
//! sandcell-admin tenant quotas acme --max-sessions 5
//! sandcell-admin tenant show acme
//! sandcell-admin key create acme        # an API key for the E2B-compatible gateway
//! sandcell-admin key list acme
//! sandcell-admin key revoke key_0123456789ab
//! ```
//! `create` prints the tenant's `SANDCELL_AMQP_URL` and `SANDCELL_DATABASE_URL` as env lines;
//! running it again for an existing tenant rotates both credentials.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use sandcell_admin::{Admin, AdminSettings};
use sandcell_core::tenants::Quotas;

#[derive(Parser)]
#[command(name = "sandcell-admin", about = "sandcell operator commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Manage tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Manage API keys (the credentials of the E2B-compatible gateway, `sandcell-gateway`).
    #[command(subcommand)]
    Key(KeyCommand),
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Make an API key for a tenant and print it (only its hash is stored: it is shown once).
    Create {
        /// Tenant name (the tenant must exist).
        tenant: String,
    },
    /// List a tenant's keys (ids and dates, never the secrets).
    List {
        /// Tenant name.
        tenant: String,
    },
    /// Revoke a key by id: the gateway refuses it from then on.
    Revoke {
        /// Key id (`key_...`).
        key_id: String,
    },
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant (or rotate its credentials) and print its connection URLs.
    Create {
        /// Tenant name: 1-64 of [a-z0-9_-].
        name: String,
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Change a tenant's quotas (unset ones keep their value).
    Quotas {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Set a tenant's broker permissions to what this version grants (e.g. live output for a
    /// tenant created before it existed), keeping its credentials.
    Permissions {
        /// Tenant name.
        name: String,
    },
    /// List every registered tenant with its quotas.
    List,
    /// Take a tenant's access away: delete its broker user and database login and set its
    /// session and job quotas to zero. Its results and artifacts stay until they expire;
    /// `tenant create` gives it new credentials later (with quotas to set again).
    Delete {
        /// Tenant name.
        name: String,
    },
    /// Print a tenant's quotas.
    Show {
        /// Tenant name.
        name: String,
    },
}

#[derive(Args)]
struct QuotaArgs {
    /// Sessions starting or active at once.
    #[arg(long)]
    max_sessions: Option<u32>,
    /// Jobs queued or running at once.
    #[arg(long)]
    max_queued_jobs: Option<u32>,
    /// Bytes of artifacts stored at once.
    #[arg(long)]
    max_artifact_bytes: Option<u64>,
    /// One-off and session-opening jobs dispatched to workers at once (fair share); more wait
    /// in Postgres, in order.
    #[arg(long)]
    max_jobs_in_flight: Option<u32>,
    /// Bytes of job results (and refusals, execution jobs kept for its sessions, upload answers,
    /// the E2B gateway's sandbox metadata and env)
    /// Postgres keeps for the tenant; past it new jobs and upload requests are refused until the
    /// retention deletes old ones.
    #[arg(long)]
    max_result_bytes: Option<u64>,
    /// Connections the tenant's database login may hold open at once (its role's connection
    /// limit, which Postgres enforces).
    #[arg(long)]
    max_db_connections: Option<u32>,
}

impl QuotaArgs {
    fn over(&self, base: Quotas) -> Quotas {
        Quotas {
            max_sessions: self.max_sessions.unwrap_or(base.max_sessions),
            max_queued_jobs: self.max_queued_jobs.unwrap_or(base.max_queued_jobs),
            max_artifact_bytes: self.max_artifact_bytes.unwrap_or(base.max_artifact_bytes),
            max_jobs_in_flight: self.max_jobs_in_flight.unwrap_or(base.max_jobs_in_flight).max(1),
            max_result_bytes: self.max_result_bytes.unwrap_or(base.max_result_bytes).max(1),
            max_db_connections: self.max_db_connections.unwrap_or(base.max_db_connections).max(1),
        }
    }
}

fn print_quotas(name: &str, q: &Quotas) {
    println!(
        "tenant {name}: max_sessions={} max_queued_jobs={} max_artifact_bytes={} max_jobs_in_flight={} max_result_bytes={} max_db_connections={}",
        q.max_sessions, q.max_queued_jobs, q.max_artifact_bytes, q.max_jobs_in_flight, q.max_result_bytes, q.max_db_connections
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let admin = Admin::connect(AdminSettings::from_env()?).await?;
    let defaults = Quotas::from_env()?;
    match cli.command {
        Command::Tenant(TenantCommand::Create { name, quotas }) => {
            let base = admin.quotas(&name).await?.unwrap_or(defaults);
            let creds = admin.create_tenant(&name, &quotas.over(base)).await?;
            println!("SANDCELL_TENANT={}", creds.tenant);
            println!("SANDCELL_AMQP_URL={}", creds.amqp_url);
            println!("SANDCELL_DATABASE_URL={}", creds.database_url);
        }
        Command::Tenant(TenantCommand::Quotas { name, quotas }) => {
            let base = admin.quotas(&name).await?.unwrap_or(defaults);
            let q = quotas.over(base);
            admin.set_quotas(&name, &q).await?;
            print_quotas(&name, &q);
        }
        Command::Tenant(TenantCommand::Permissions { name }) => {
            admin.grant_broker_permissions(&name).await?;
            println!("tenant {name}: broker permissions set");
        }
        Command::Tenant(TenantCommand::List) => {
            for (name, q, login) in admin.list_tenants().await? {
                print_quotas(&name, &q);
                if !login {
                    println!("  (no database login: deleted, or only ever used through a trusted backend)");
                }
            }
        }
        Command::Tenant(TenantCommand::Delete { name }) => {
            if !admin.delete_tenant(&name).await? {
                anyhow::bail!("no tenant {name:?}");
            }
            println!("tenant {name}: broker user and database login deleted, quotas zero");
        }
        Command::Key(KeyCommand::Create { tenant }) => {
            let key = admin.api_keys().create(&tenant).await?;
            println!("SANDCELL_API_KEY_ID={}", key.id);
            println!("SANDCELL_API_KEY={}", key.key);
            println!("E2B_API_KEY={}", key.key);
        }
        Command::Key(KeyCommand::List { tenant }) => {
            for (id, created, revoked) in admin.api_keys().list(&tenant).await? {
                match revoked {
                    Some(at) => println!("{id} created {created} revoked {at}"),
                    None => println!("{id} created {created}"),
                }
            }
        }
        Command::Key(KeyCommand::Revoke { key_id }) => {
            if !admin.api_keys().revoke(&key_id).await? {
                anyhow::bail!("no live key {key_id:?}");
            }
            println!("{key_id}: revoked");
        }
        Command::Tenant(TenantCommand::Show { name }) => {
            let q = admin.quotas(&name).await?.with_context(|| format!("no tenant {name:?}"))?;
            print_quotas(&name, &q);
        }
    }
    Ok(())
}
