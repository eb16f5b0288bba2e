//! What every operation needs: the root, who we are, how much to say, how the store is shared.

use std::io::Write;

use crate::ident::Me;
use crate::root::Root;

/// What every operation needs to know.
#[derive(Clone)]
pub struct Ctx {
    pub root: Root,
    pub me: Me,
    pub quiet: bool,
    pub verbose: bool,
    /// The umask spawned commands get back if a group-shared store changed ours (`Some`: shared).
    pub child_umask: Option<u32>,
    /// Whether a missing root is created (commands that write) or reported as
    /// [`crate::error::Error::NoRoot`], creating nothing (commands that read).
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
            self.warn(msg);
        }
    }

    /// Prints, even with `-q`, a line saying the command was skipped or what it did failed: `-q`
    /// silences progress and waiting, never what a caller must learn of its request's fate.
    pub fn warn(&self, msg: &str) {
        // Never eprintln!: it panics when stderr is gone, and a panic mid-exec would release locks
        // the command relies on. One line each: a name may hold a newline or an escape.
        let msg = crate::ident::printable(msg);
        let _ = writeln!(std::io::stderr(), "stowage: {msg}");
    }

    /// Prints a message only with --verbose.
    pub fn detail(&self, msg: &str) {
        if self.verbose {
            self.say(msg);
        }
    }
}
