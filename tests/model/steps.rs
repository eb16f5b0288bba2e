//! The protocol's steps: what each operation does, in order, and the
//! functions of `src/` that do it.
//!
//! - docs/design.md lists the same steps in its `model-steps` block;
//!   `steps_match_design_md` compares the two.
//! - `every_step_names_a_function_of_src` checks that each named function
//!   exists, so a renamed or removed one makes the model say so.
//! - `no_transaction_step_waits`: no step under the global lock blocks.

/// Defines `Step`, `ALL` and each step's name and functions.
macro_rules! steps {
    ($($step:ident $name:literal [$($f:literal)*])*) => {
        /// One step of a process, as the model takes it (atomically).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Step { $($step),* }

        pub const ALL: &[Step] = &[$(Step::$step),*];

        impl Step {
            /// The name docs/design.md uses, and the functions of `src/`
            /// that implement the step (`module::function`).
            pub fn spec(self) -> (&'static str, &'static [&'static str]) {
                match self { $(Step::$step => ($name, &[$($f),*])),* }
            }
        }
    };
}

steps! {
    SlotTry "slot-try" ["acquire::slot::take" "acquire::slot::try_first" "nested::enclosing"]
    SlotWait "slot-wait" ["acquire::slot::wait_for_slot"]
    Try "try" ["acquire::image::take" "acquire::image::try_image" "lock::acquire_no_wait_with"
        "image_record::read" "acquire::image::require_all"]
    Gate "gate" ["acquire::image::wait_image" "image_record::set_writer_waits"]
    Wait "wait" ["acquire::image::wait_image" "lock::acquire" "lock::still_linked"]
    Check "check" ["session::attempt" "session::settle_store_wide" "store_wide::probe"
        "session::check_reads" "cli::rm::take_all"]
    ClearHints "clear-hints" ["store_wide::clear_hints"]
    StoreAwait "store-await" ["store_wide::wait_free"]
    FinishRemoval "finish-removal" ["session::finish_removal"]
    Start "start" ["session::start_writes" "session::write_record" "image_record::write"]
    Mkdir "mkdir" ["session::start_new" "session::make_missing_tree" "session::refuse_planted"]
    Clone "clone" ["exec::copy_base" "session::clone_into" "remove::empty_image_dir"]
    ReleaseBase "release-base" ["session::release_read"]
    Spawn "spawn" ["exec::run" "command::start" "session::set_inheritable"]
    Command "command" ["command::wait"]
    Finish "finish" ["session::finish" "session::finish_write" "lock::still_held"]
    Abandon "abandon" ["session::abandon"]
    Release "release" ["session::release" "remove::release_unclaimed" "root::unlink_lock"
        "dir::unlink_if"]
    Mark "mark" ["remove::remove_held" "image_record::write"]
    Trash "trash" ["remove::take_out"]
    DropRecord "drop" ["root::drop_record" "image_record::clear"]
    DeleteTrash "delete-trash" ["dir::remove_entry"]
    ListInterrupted "list-interrupted" ["gc::finish_interrupted" "census::take"]
    LockInterrupted "lock-interrupted" ["gc::finish_removals" "gc::take_to_repair" "gc::take_exclusive"
        "store_wide::blocks" "remove::finish_held"]
    Survey "survey" ["survey::survey" "survey::refresh" "store::connection" "census::take"
        "migrate::run"]
    Collect "collect" ["gc::collect" "gc::qualifies" "gc::take_exclusive"]
    DocRecords "doc-records" ["doctor::records" "census::take"]
    DocHints "doc-hints" ["doctor::hints" "store_wide::probe"]
    ClearHint "clear-hint" ["doctor::hints" "image_record::set_store_wide"]
    DocTrees "doc-trees" ["doctor::trees" "census::take"]
    DropMissing "drop-missing" ["doctor::missing_trees" "gc::take_to_repair" "root::drop_record"]
    ListOrphans "list-orphans" ["survey::orphans"]
    Adopt "adopt" ["adopt::adopt" "store_wide::probe" "image_record::write"]
    DocLeftovers "doc-leftovers" ["doctor::leftovers" "census::take"]
    UnlinkEmpty "unlink-empty" ["doctor::leftovers" "lock::acquire_no_wait" "root::unlink_lock"]
    StoreLock "store-lock" ["store_wide::take" "store_wide::take_raw"
        "nested::enclosing"]
    Hint "hint" ["store_wide::quiesce" "store_wide::hint" "image_record::set_store_wide"]
    Pass "pass" ["store_wide::quiesce" "store_wide::pass" "image_record::set_store_wide"]
    PassWait "pass-wait" ["store_wide::wait_for_image" "lock::acquire"]
    Forget "forget" ["store_wide::forget_deleted" "root::drop_record"]
    StoreRelease "store-release" ["store_wide::release"]
}

impl Step {
    pub fn name(self) -> &'static str {
        self.spec().0
    }

    pub fn code(self) -> &'static [&'static str] {
        self.spec().1
    }

    /// Steps under the global lock (one catalog transaction).
    pub fn in_transaction(self) -> bool {
        self == Step::Survey
    }

    /// Steps that may block on a lock.
    pub fn blocks(self) -> bool {
        use Step::*;
        matches!(
            self,
            SlotWait | Gate | Wait | StoreAwait | StoreLock | PassWait
        )
    }

    fn named(name: &str) -> Step {
        *ALL.iter()
            .find(|s| s.name() == name)
            .unwrap_or_else(|| panic!("no step {name}"))
    }
}

/// The operations, with their steps in protocol order (a step that
/// repeats, such as one image lock after another, is listed once).
pub fn protocol() -> Vec<(&'static str, Vec<Step>)> {
    [
        (
            "exec",
            "slot-try slot-wait try gate wait check clear-hints store-await finish-removal \
             start mkdir clone release-base spawn command finish abandon release",
        ),
        (
            "store-wide",
            "store-lock hint pass pass-wait spawn command forget store-release",
        ),
        (
            "rm",
            "try gate wait check clear-hints mark trash drop delete-trash release",
        ),
        (
            "gc",
            "list-interrupted lock-interrupted trash drop survey collect mark delete-trash",
        ),
        (
            "doctor",
            "doc-records lock-interrupted trash drop doc-hints clear-hint doc-trees \
             drop-missing list-orphans adopt doc-leftovers unlink-empty survey",
        ),
    ]
    .into_iter()
    .map(|(op, steps)| (op, steps.split_whitespace().map(Step::named).collect()))
    .collect()
}
