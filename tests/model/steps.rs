//! The protocol's steps: what each operation does, in order, and the
//! function of `src/` that does it. docs/design.md lists the same steps in
//! its "Protocol steps" block; `steps_match_design_md` compares the two, and
//! `every_step_names_a_function_of_src` checks that each named function
//! exists, so a renamed or removed function makes the model say so.

/// One step of a process, as the model takes it (atomically).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    LeaseCreate,
    LeaseLock,
    FastTry,
    FastStore,
    FastWrite,
    Marker,
    Writing,
    Record,
    PutBack,
    Fold,
    FoldUnlink,
    Invalidate,
    Token,
    StoreLock,
    StoreRecord,
    StoreFree,
    StoreWaitFree,
    StoreAwait,
    StoreEnd,
    SlotTry,
    SlotWaiter,
    SlotWait,
    Try,
    Waiter,
    Gate,
    Wait,
    Start,
    Clone,
    ReleaseBase,
    Spawn,
    Command,
    Abandon,
    Finish,
    Release,
    Mark,
    Trash,
    DropRow,
    Unlink,
    DeleteTrash,
    ListInterrupted,
    LockInterrupted,
    OrphanLock,
    Sweep,
    CleanLock,
    CleanUnlink,
    Collect,
}

pub const ALL: &[Step] = &[
    Step::LeaseCreate,
    Step::LeaseLock,
    Step::FastTry,
    Step::FastStore,
    Step::FastWrite,
    Step::Marker,
    Step::Writing,
    Step::Record,
    Step::PutBack,
    Step::Fold,
    Step::FoldUnlink,
    Step::Invalidate,
    Step::Token,
    Step::StoreLock,
    Step::StoreRecord,
    Step::StoreFree,
    Step::StoreWaitFree,
    Step::StoreAwait,
    Step::StoreEnd,
    Step::SlotTry,
    Step::SlotWaiter,
    Step::SlotWait,
    Step::Try,
    Step::Waiter,
    Step::Gate,
    Step::Wait,
    Step::Start,
    Step::Clone,
    Step::ReleaseBase,
    Step::Spawn,
    Step::Command,
    Step::Abandon,
    Step::Finish,
    Step::Release,
    Step::Mark,
    Step::Trash,
    Step::DropRow,
    Step::Unlink,
    Step::DeleteTrash,
    Step::ListInterrupted,
    Step::LockInterrupted,
    Step::OrphanLock,
    Step::Sweep,
    Step::CleanLock,
    Step::CleanUnlink,
    Step::Collect,
];

impl Step {
    /// The name docs/design.md uses.
    pub fn name(self) -> &'static str {
        match self {
            Step::LeaseCreate => "lease-create",
            Step::LeaseLock => "lease-lock",
            Step::FastTry => "fast-try",
            Step::FastStore => "fast-store",
            Step::FastWrite => "fast-write",
            Step::Marker => "marker",
            Step::Writing => "writing",
            Step::Record => "record",
            Step::PutBack => "put-back",
            Step::Fold => "fold",
            Step::FoldUnlink => "fold-unlink",
            Step::Invalidate => "invalidate",
            Step::Token => "token",
            Step::StoreLock => "store-lock",
            Step::StoreRecord => "store-record",
            Step::StoreFree => "store-free",
            Step::StoreWaitFree => "store-wait-free",
            Step::StoreAwait => "store-await",
            Step::StoreEnd => "store-end",
            Step::SlotTry => "slot-try",
            Step::SlotWaiter => "slot-waiter",
            Step::SlotWait => "slot-wait",
            Step::Try => "try",
            Step::Waiter => "waiter",
            Step::Gate => "gate",
            Step::Wait => "wait",
            Step::Start => "start",
            Step::Clone => "clone",
            Step::ReleaseBase => "release-base",
            Step::Spawn => "spawn",
            Step::Command => "command",
            Step::Abandon => "abandon",
            Step::Finish => "finish",
            Step::Release => "release",
            Step::Mark => "mark",
            Step::Trash => "trash",
            Step::DropRow => "drop-row",
            Step::Unlink => "unlink",
            Step::DeleteTrash => "delete-trash",
            Step::ListInterrupted => "list-interrupted",
            Step::LockInterrupted => "lock-interrupted",
            Step::OrphanLock => "orphan-lock",
            Step::Sweep => "sweep",
            Step::CleanLock => "clean-lock",
            Step::CleanUnlink => "clean-unlink",
            Step::Collect => "collect",
        }
    }

    /// The functions of `src/` that implement the step (`module::function`,
    /// `Type::method` inside the module).
    pub fn code(self) -> &'static [&'static str] {
        match self {
            Step::LeaseCreate => &["lease::mine", "lease::create", "lock::open"],
            Step::LeaseLock => &[
                "lease::create",
                "lock::create_locked",
                "lock::still_at_path",
            ],
            Step::FastTry => &[
                "session::begin_fast",
                "acquire::image::try_ready",
                "lock::acquire_no_wait_vouched",
                "record::read_file",
                "record::set_hint",
            ],
            Step::FastStore => &[
                "session::begin_fast",
                "store_wide::try_shared",
                "record::set_hint",
            ],
            Step::FastWrite => &[
                "session::begin_fast",
                "acquire::image::try_write",
                "lock::acquire_no_wait_vouched",
                "record::found",
            ],
            Step::Marker => &["session::start_fast_writes", "written::mark"],
            Step::Writing => &["session::start_fast_writes", "record::write_record"],
            Step::Record => &[
                "session::finish_fast",
                "lock::still_held",
                "record::write_record",
            ],
            Step::PutBack => &["session::abandon", "record::put_back"],
            Step::Fold => &[
                "store::begin_raw",
                "written::markers",
                "lock::held_exclusively_here",
                "written::fold",
                "written::fold_found",
                "remove::recheck",
            ],
            Step::FoldUnlink => &["store::begin_raw", "written::unlink_folded"],
            Step::Invalidate => &[
                "record::invalidate",
                "record::invalidate_at",
                "session::start",
                "remove::remove_locked",
                "store_wide::forget_deleted",
                "records_db::for_this_database",
            ],
            Step::Token => &["record::write_ready", "session::finish"],
            Step::StoreLock => &[
                "store_wide::take",
                "lock::acquire",
                "nested::enclosing_hold",
            ],
            Step::StoreRecord => &["store_wide::take", "record::mark_store_wide"],
            Step::StoreFree => &[
                "store::global_with_images_free",
                "store::first_busy_image",
                "nested::enclosing_hold",
            ],
            Step::StoreWaitFree => &["store::global_with_images_free", "lock::acquire"],
            Step::StoreAwait => &["store_wide::wait_until_free", "lock::acquire"],
            Step::StoreEnd => &[
                "store_wide::release",
                "store_wide::forget_deleted",
                "record::mark_store_wide",
            ],
            Step::SlotTry => &[
                "acquire::slot::acquire_unrecorded",
                "lock::acquire_any",
                "nested::enclosing_hold",
            ],
            Step::SlotWaiter => &["acquire::slot::acquire_unrecorded", "judge::class_report"],
            Step::SlotWait => &["lock::acquire_any", "lock::wait::block_any"],
            Step::Try => &[
                "acquire::image::try_image",
                "lock::acquire_no_wait",
                "lock::still_linked",
                "nested::enclosing_hold",
            ],
            Step::Waiter => &[
                "acquire::image::acquire_image",
                "judge::prune",
                "lease::probe",
            ],
            Step::Gate => &[
                "acquire::image::wait_image",
                "lock::acquire",
                "record::set_hint",
            ],
            Step::Wait => &[
                "acquire::image::wait_image",
                "lock::acquire_any",
                "lock::still_linked",
                "record::set_hint",
            ],
            Step::Start => &[
                "session::start",
                "session::prepare_write",
                "store_wide::check",
                "record::write_ready",
            ],
            Step::Clone => &["session::clone_into"],
            Step::ReleaseBase => &["session::release_read"],
            Step::Spawn => &["exec::run", "lock::set_inheritable", "keeper::main"],
            Step::Command => &["signals::wait"],
            Step::Abandon => &["session::abandon"],
            Step::Finish => &["session::finish", "lock::verify", "record::write_ready"],
            Step::Release => &[
                "lock::Guard",
                "session::give_up",
                "remove::release_unclaimed",
                "lease::retire",
            ],
            Step::Mark => &[
                "remove::remove_locked",
                "remove::recheck",
                "store_wide::check_busy",
            ],
            Step::Trash => &["remove::take_out"],
            Step::DropRow => &["remove::remove_locked"],
            Step::Unlink => &["remove::unlink_lock", "dir::unlink_if"],
            Step::DeleteTrash => &["dir::remove_entry"],
            Step::ListInterrupted => &["remove::finish_interrupted"],
            Step::LockInterrupted => &["remove::finish_interrupted", "remove::recheck"],
            Step::OrphanLock => &["remove::finish_interrupted", "remove::recheck"],
            Step::Sweep => &[
                "judge::sweep",
                "judge::prune",
                "lease::probe",
                "doctor::find_inconsistencies",
            ],
            Step::CleanLock => &[
                "lease::clean",
                "lease::clean_listed",
                "lock::acquire_no_wait",
            ],
            Step::CleanUnlink => &["lease::clean", "lock::unlink_lease"],
            Step::Collect => &["gc::collect", "remove::recheck"],
        }
    }

    /// Steps that run inside one global-lock transaction.
    pub fn in_transaction(self) -> bool {
        matches!(
            self,
            Step::StoreRecord
                | Step::Fold
                | Step::FoldUnlink
                | Step::StoreFree
                | Step::StoreEnd
                | Step::CleanLock
                | Step::CleanUnlink
                | Step::SlotWaiter
                | Step::Waiter
                | Step::ReleaseBase
                | Step::Start
                | Step::Abandon
                | Step::Finish
                | Step::Mark
                | Step::DropRow
                | Step::ListInterrupted
                | Step::Sweep
        )
    }

    /// Steps that may block on a lock.
    pub fn blocks(self) -> bool {
        matches!(
            self,
            Step::SlotWait
                | Step::Gate
                | Step::Wait
                | Step::StoreLock
                | Step::StoreWaitFree
                | Step::StoreAwait
        )
    }
}

/// The operations, with their steps in protocol order (a step that repeats,
/// such as one image lock after another, is listed once).
pub fn protocol() -> Vec<(&'static str, Vec<Step>)> {
    use Step::*;
    let remove = [Invalidate, Mark, Trash, DropRow, Unlink, DeleteTrash];
    // (A transaction's fold, listed once per operation where it first
    // comes: before `waiter`, `start`, `mark`, `sweep`.)
    let lease = [LeaseCreate, LeaseLock];
    let look = [Sweep, CleanLock, CleanUnlink];
    let fold = [Fold, FoldUnlink];
    vec![
        (
            "exec",
            lease
                .into_iter()
                .chain([
                    FastTry,
                    FastStore,
                    FastWrite,
                    Marker,
                    Writing,
                    SlotTry,
                    SlotWaiter,
                    SlotWait,
                    Try,
                    Waiter,
                    Gate,
                    Wait,
                    Invalidate,
                    Fold,
                    FoldUnlink,
                    Start,
                    StoreAwait,
                    Clone,
                    ReleaseBase,
                    Spawn,
                    Command,
                    PutBack,
                    Abandon,
                    Record,
                    Finish,
                    Token,
                    Release,
                ])
                .collect(),
        ),
        (
            "store-wide",
            vec![
                StoreLock,
                StoreRecord,
                StoreFree,
                StoreWaitFree,
                Spawn,
                Command,
                Invalidate,
                StoreEnd,
                Release,
            ],
        ),
        (
            "rm",
            lease
                .into_iter()
                .chain([Try, Fold, FoldUnlink, Waiter, Gate, Wait])
                .chain(remove)
                .chain([Release])
                .collect(),
        ),
        (
            "gc",
            lease
                .into_iter()
                .chain([ListInterrupted, LockInterrupted, Invalidate])
                .chain(fold)
                .chain(remove.into_iter().skip(1))
                .chain([OrphanLock])
                .chain(look)
                .chain([Collect, Release])
                .collect(),
        ),
        (
            "doctor",
            fold.into_iter()
                .chain(look)
                .chain([ListInterrupted, LockInterrupted])
                .chain(remove)
                .chain([OrphanLock])
                .collect(),
        ),
        ("look", look.to_vec()),
    ]
}
