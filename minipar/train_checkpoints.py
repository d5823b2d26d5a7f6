"""The trainer's checkpoints: a run resumed from one (--load) and the ones it saves (--save,
--keep-checkpoints). The files themselves are ``checkpoint/sharded.py``'s; this is what the
trainer keeps in them besides the model and optimizer: where the run stands (iteration, seed,
batch), what made its tokens, its learning-rate schedule and fp16's loss scale."""

from minipar.checkpoint import sharded
from minipar.lr_schedule import schedule_state
from minipar.run_inputs import tokens_of
from minipar.token_cache import RECIPE
from minipar.train_report import last_checkpoint


class Checkpoints:
    """Mixed into ``Trainer``, whose model, optimizer, grid, args and scaler it reads."""

    def _resume(self, scaler):
        """--load: the checkpoint's state into the model, optimizer and trainer, on every rank or
        on none; --save: the partial saves a crash left removed (once every rank has read)."""
        args, world = self.args, self.world
        if args.load:
            failed = None
            try:  # what the index says (read alike by every rank) or a damage one rank found
                self._load(args, scaler)
            except sharded.CheckpointError as exc:
                if exc.speaks is not None:  # already agreed on by every rank (reshard.load's reads)
                    raise
                failed = exc
            sharded.agree_on_failure(world, failed, f"the checkpoint {args.load} was not loaded")
        if args.save:  # the save directory's lock is ours (run_inputs.claim_save_directory)
            # the checkpoint loaded may be iter_N.old, which rank 0 puts back under its own name:
            # only once every rank has read it
            world.barrier()
            if self.speaks:
                sharded.remove_stale_partials(args.save)

    def _load(self, args, scaler):
        state = sharded.load(args.load, self.model, self.opt, self.grid)
        if "calls" in state["rng"]:
            raise sharded.CheckpointError(
                f"{args.load} was saved when dropout masks followed a count of calls; masks are now "
                "keyed by position, so it cannot resume exactly: start the run again")
        self.model.rng.seed = state["rng"]["seed"]  # the iteration, which keys the masks with it, is self.start
        if scaler is not None and "loss_scaler" in state:  # an fp16 run's scale goes on where it was
            try:
                scaler.load_state_dict(state["loss_scaler"])
            except (KeyError, TypeError, ValueError) as exc:
                raise sharded.CheckpointError(f"{args.load}: its loss_scaler state is not one: {exc!r}") from None
        self.start = state["iteration"]
        self.stuck = state.get("skipped_in_a_row", 0)  # 0 for checkpoints from before it was saved

    def _save_said(self, iteration):
        """The watchdog's name for a save that has not ended: whether ``latest`` names it by then
        (a rank that stopped in the last vote leaves it published)."""
        named = last_checkpoint(self.args.save) == iteration
        return (f"the checkpoint of iteration {iteration} (" +
                ("published: latest names it" if named else "not published: latest names the one before") + ")")

    def save(self, iteration):
        state = {"iteration": iteration, "seed": self.args.seed, "batch_size": self.args.batch_size,
                 "rng": {"seed": self.model.rng.seed}, "corpus": [self.data.size, self.data.sha256],
                 "tokenizer": tokens_of(self.args), "hf_token_ids": self.args.hf_token_ids,  # for --export-hf
                 "schedule": schedule_state(self.args)}
        if self.args.tokenizer is not None:  # how its files were read (a resume by another recipe is refused)
            state["token_recipe"] = RECIPE
        if self.scaler is not None:
            state["loss_scaler"], state["skipped_in_a_row"] = self.scaler.state_dict(), self.stuck
        saved = sharded.save(self.args.save, iteration, self.model, self.opt, self.grid, state)
        if self.args.keep_checkpoints and self.speaks:
            sharded.prune(self.args.save, self.args.keep_checkpoints)
        return saved
