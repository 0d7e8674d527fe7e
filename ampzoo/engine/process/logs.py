"""What goes into train.log alone (the console already has the line, or should not get the trace), and the
console of an msrun rank other than 0."""
import logging
import sys
import traceback


def file_handlers() -> list:
    return [h for h in logging.root.handlers if isinstance(h, logging.FileHandler)]


def log_line(text: str, level: int = logging.WARNING) -> None:
    """A line for train.log only (the console already has it)."""
    for handler in file_handlers():
        handler.handle(logging.LogRecord("amp_zoo", level, __file__, 0, "%s", (text,), None))


def log_trace(error: BaseException) -> None:
    """The full trace of an error reported in one line, into train.log only; a rank without one (under msrun,
    ranks other than 0) prints it into its own worker log, msrun's file of its output."""
    trace = "".join(traceback.format_exception(error))
    if file_handlers():
        log_line(trace, logging.ERROR)
    else:
        print(trace, file=sys.stderr, flush=True)


def every_rank_or_warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or getattr(record, "every_rank", False)


def rank_logging() -> None:
    """A rank other than 0 (under msrun): no train.log (rank 0 writes it), and on its console, which msrun keeps
    as its worker log and tails to the user's terminal, only warnings, errors and the lines every rank must say
    (`extra={"every_rank": True}`, such as its parameter checksum): not every line once per rank."""
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler):
            logging.root.removeHandler(handler)
        else:
            handler.addFilter(every_rank_or_warning)
