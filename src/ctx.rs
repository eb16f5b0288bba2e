//! What every operation needs besides the database: the root, who we are,
//! how much to say, and how the store is shared.

use std::cell::Cell;
use std::io::Write;

use crate::ident::Me;
use crate::lock::Mode;
use crate::meta::{LockKind, Record, Role};
use crate::root::Root;

/// What every operation needs to know besides the database.
pub struct Ctx {
    pub root: Root,
    pub me: Me,
    pub quiet: bool,
    pub verbose: bool,
    /// The umask a spawned command gets back, when ours was changed for a
    /// group-shared store (which is also how to tell that it is one).
    pub child_umask: Option<u32>,
    /// Set once a "waiting for the global lock" notice has been printed.
    pub(crate) noticed_global: Cell<bool>,
    /// Whether a root that does not exist is created (commands that write)
    /// or reported, creating nothing ([`crate::error::Error::NoRoot`]: commands that read).
    pub creates_root: bool,
}

impl Ctx {
    /// The context of a process working on the store at `root`.
    pub fn new(root: Root) -> Ctx {
        Ctx {
            root,
            me: Me::current(),
            quiet: false,
            verbose: false,
            child_umask: None,
            noticed_global: Cell::new(false),
            creates_root: true,
        }
    }

    /// The root is shared by a group: what we create must be group-writable.
    pub fn shared(&self) -> bool {
        self.child_umask.is_some()
    }

    /// Prints a progress or waiting message unless quiet.
    pub fn say(&self, msg: &str) {
        if !self.quiet {
            // Never eprintln!: it panics when stderr is gone, and a panic
            // mid-exec would release locks the command still relies on.
            let _ = writeln!(std::io::stderr(), "stowage: {msg}");
        }
    }

    /// Prints a message only with --verbose.
    pub fn detail(&self, msg: &str) {
        if self.verbose && !self.quiet {
            let _ = writeln!(std::io::stderr(), "stowage: {msg}");
        }
    }

    /// A record of this process for a lock it holds or awaits, from now,
    /// naming its lease (made now if it has none yet). A lease that cannot
    /// be made (a user who may lock the store's files but not create one
    /// under `locks/`) leaves the record to be judged by pid, as before
    /// leases: information only, never exclusion, depends on it.
    pub fn record(
        &self,
        kind: LockKind,
        name: &str,
        lockfile: String,
        role: Role,
        mode: Mode,
        command: &str,
    ) -> Record {
        let mut r = Record::ours(&self.me, kind, name, lockfile, role, mode, command);
        r.lease = crate::lease::mine(&self.root.leases()).ok();
        r
    }
}
