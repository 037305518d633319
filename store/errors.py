"""The errors store/ raises. Each names the bad value; the CLI prints them without a traceback."""


class StoreError(Exception):
    """Base of every error store/ raises on purpose."""


class SchemaTooNew(StoreError):
    """The database was written by a newer Tessera whose schema this one does not know."""


class SchemaMismatch(StoreError):
    """A read-only open found a database that is not at this Tessera's schema version."""


class ReadOnlyStore(StoreError):
    """A write was asked of a store opened read-only."""


class StoreClosed(StoreError):
    """A write or flush was asked of a store or tracer that has been closed."""


class FlushTimeout(StoreError):
    """Queued writes did not reach the disk in time (the database stayed locked or failing)."""


class NotJSON(StoreError, TypeError):
    """A setting value or an event detail cannot be written as JSON."""


class UnknownEventKind(StoreError, ValueError):
    """What was emitted is not an event of `tessera.store.events.EVENT_TYPES`."""


class BadTraceField(StoreError, ValueError):
    """A trace event carries a field that is not a trace column, or a value of the wrong type."""


class BadRecord(StoreError, ValueError):
    """A claim, session, ledger, ban or report write carries a value of the wrong type or range."""


class ReportTooLarge(StoreError, ValueError):
    """A misbehaviour report's raw bytes exceed `tessera.store.db.MAX_REPORT_BYTES`."""


class KeyFileError(StoreError):
    """Base of the errors about the peer's private key file."""


class KeyFileTooOpen(KeyFileError):
    """The key file can be read or written by group or others; it must be mode 0600."""


class KeyFileWrongSize(KeyFileError):
    """The key file does not hold exactly a 32-byte Ed25519 seed."""


class KeyFileNotOwned(KeyFileError):
    """The key file belongs to another user than the one running the peer."""


class NotATraceDatabase(StoreError):
    """A path given to export or plot is not a Tessera database with a trace table."""


class BadTraceRow(NotATraceDatabase):
    """A stored trace row has no usable time or peer id, so it cannot be placed on a timeline."""


class BadTimeWindow(StoreError, ValueError):
    """A --since/--until/--session window that names no time or selects nothing."""
