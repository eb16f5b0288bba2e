//! `stowage slots`: show, set and remove slot classes.

use anyhow::Result;
use clap::Subcommand;
use serde::Serialize;

use crate::holders::Party;
use crate::ident::STOWAGE;
use crate::slots::{self, MAX_LIMIT, MAX_RESERVE};
use crate::store::Store;

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    stowage slots set pull 4 --reserve-high 1   # 4 pulls at once, +1 for urgent small requests\n  \
    stowage slots set load/podman 2             # a daemonless runtime: 2 loads at once\n  \
    stowage slots set load/docker 0             # a daemon coordinates: no limit\n  \
    stowage exec --slot pull --write alpine -- ./pull alpine")]
pub struct Args {
    #[command(subcommand)]
    pub(super) action: Option<Action>,
    /// Print JSON (when showing)
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
pub(super) enum Action {
    /// Create or change a class: at most LIMIT normal holders (0: unlimited)
    Set {
        /// The class (pull, load/podman): lowercase letters, digits, ., _, - in parts joined by /
        class: String,
        /// Normal holders at once (0 = unlimited)
        #[arg(allow_hyphen_values = true)]
        limit: String,
        /// Extra slots only --priority high may take [default: the class's, else 0]
        #[arg(long, value_name = "N", allow_hyphen_values = true)]
        reserve_high: Option<String>,
    },
    /// Remove a class (current holders keep their slots until they finish)
    Rm {
        /// The class to remove
        class: String,
    },
}

#[derive(Serialize)]
struct ClassJson<'a> {
    name: &'a str,
    limit: u32,
    reserve_high: u32,
    in_use: u32,
    holders: &'a [Party],
    waiters: &'a [Party],
}

pub fn run(args: Args, store: &mut Store) -> Result<u8> {
    crate::migrate::if_needed(store, None)?;
    match args.action {
        None => show(store, args.json),
        Some(Action::Set {
            class,
            limit,
            reserve_high,
        }) => {
            slots::validate_class(&class)?;
            let limit = number("LIMIT", &limit, MAX_LIMIT)?;
            let reserve_high = reserve_high
                .map(|r| number("--reserve-high", &r, MAX_RESERVE))
                .transpose()?;
            if limit == 0 && reserve_high.is_some_and(|r| r > 0) {
                return super::usage(format!(
                    "slot class '{class}': a reserve for high priority needs a limit (LIMIT 0 means unlimited)"
                ));
            }
            let set = slots::set(store, &class, limit, reserve_high)?;
            store.ctx().say(&match (set.limit, set.reserve) {
                (0, _) => format!("slot class '{class}': unlimited"),
                (n, 0) => format!("slot class '{class}': at most {n} at once"),
                (n, r) => {
                    format!("slot class '{class}': at most {n} at once, {r} more for high priority")
                }
            });
            Ok(0)
        }
        Some(Action::Rm { class }) => {
            slots::validate_class(&class)?;
            store.require_root()?;
            let busy = slots::remove(store, &class)?;
            store.ctx().say(&if busy > 0 {
                format!("slot class '{class}' removed; {busy} holder(s) keep their slots until they finish")
            } else {
                format!("slot class '{class}' removed")
            });
            Ok(0)
        }
    }
}

fn number(what: &str, raw: &str, max: u32) -> Result<u32> {
    match raw.trim().parse::<u32>() {
        Ok(n) if n <= max => Ok(n),
        _ => super::usage(format!(
            "{what} '{raw}': must be a whole number from 0 to {max}"
        )),
    }
}

fn show(store: &mut Store, json: bool) -> Result<u8> {
    use crate::slot_limits::Class;
    store.require_root()?;
    let root = store.root().clone();
    // Something planted in a lock directory's place is not "no classes".
    root.check_lock_dirs(|line| store.ctx().say(line))?;
    // A class whose limits cannot be read is not listed: said why, once.
    let classes = slots::classes(&root);
    // A class a later release wrote: that release's store, refused whole (before anything is said).
    slots::refuse_newer(&root, &classes)?;
    let damaged: Vec<_> = classes
        .into_iter()
        .filter(|(_, c)| matches!(c, Class::Damaged | Class::Emptied))
        .collect();
    for (class, _) in &damaged {
        // Read again: advice to set them again only for limits read and found bad.
        let why = match slots::read_class(&root, class) {
            Err(e) => format!("{e:#}"),
            Ok(Class::Damaged) => format!(
                "the limits of slot class '{class}' are damaged; set them again with '{STOWAGE} slots set {class} LIMIT'"
            ),
            Ok(Class::Emptied) => slots::emptied(&root, class),
            Ok(_) => continue,
        };
        store.ctx().say(&why);
    }
    let look = crate::holders::Look::new(store.ctx());
    let reports: Vec<_> = slots::reports(&look, &root)?
        .into_iter()
        .filter_map(|r| Some((r.slot?, r)))
        .collect();
    if json {
        let out: Vec<ClassJson> = reports
            .iter()
            .map(|((limit, reserve_high, in_use), r)| ClassJson {
                name: &r.name,
                limit: *limit,
                reserve_high: *reserve_high,
                in_use: *in_use,
                holders: &r.holders,
                waiters: &r.waiters,
            })
            .collect();
        return super::print_json(&out).map(|()| 0);
    }
    // A damaged class is one, said above: not "no slot classes".
    if reports.is_empty() && !damaged.is_empty() {
        return Ok(0);
    }
    if reports.is_empty() {
        let none = format!(
            "no slot classes; add one with '{STOWAGE} slots set CLASS LIMIT [--reserve-high N]'\n"
        );
        return super::print(&none).map(|()| 0);
    }
    let head = ["CLASS", "LIMIT", "RESERVE HIGH", "IN USE", "WAITING"];
    let mut rows = vec![head.map(String::from)];
    for ((limit, reserve, in_use), r) in reports {
        let limit = (limit > 0).then(|| limit.to_string());
        rows.push([
            r.name,
            limit.unwrap_or_else(|| "unlimited".into()),
            reserve.to_string(),
            in_use.to_string(),
            r.waiters.len().to_string(),
        ]);
    }
    super::print(&super::table(&rows)).map(|()| 0)
}
