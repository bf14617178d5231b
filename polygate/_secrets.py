"""The one place that decides what a secret is, what it may look like, and how text
is cleaned of it.

A secret is an API key, or the password of a backend or telemetry URL.  It can reach
a message in more than its raw form: an HTTP library quotes the header value it
refused (``b'Bearer sk-\\x00…'``), a ``repr`` escapes it, a JSON body escapes it, a
URL percent-encodes it.  :func:`redact` replaces every one of those forms, and it
runs *before* any truncation: text is cut only after it is clean, and a cut text
loses its last word too, which may be the first characters of a secret (an excerpt
that stopped mid-key): see :func:`clip`.

Secrets shorter than :data:`MIN_SECRET_LEN` characters are not searched for: they
would garble messages more than they protect.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar
from urllib.parse import quote, unquote

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "MIN_SECRET_LEN",
    "QUOTE_MAX",
    "clip",
    "frameless",
    "frameless_on",
    "given",
    "is_header_safe",
    "mask_prefixes",
    "masked",
    "redact",
    "url_secrets",
]

MIN_SECRET_LEN = 4
MASK = "***"
#: An API key as it can travel in an ``Authorization`` header: visible ASCII, no
#: blanks, no control characters (a pasted key with a zero-width space fails here,
#: at construction, instead of in every request).
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


def is_header_safe(key: str) -> bool:
    return _HEADER_SAFE.fullmatch(key) is not None


#: Characters of a refused string a message may quote: a number, a flag or a name is
#: short, and a longer value is more likely a key pasted in the wrong place.
QUOTE_MAX = 24
#: A refused integer is quoted up to this many bits (~30 digits); past it, ``repr``
#: grows with the value, and past 4,300 digits it raises ValueError itself.
_INT_BITS_MAX = 100


def printable(text: str) -> str:
    """``text`` with each character that is not printable escaped (``\\n``, ``\\x1b``):
    shown on one line, and nothing in it a terminal would act on (a path, a name)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def given(value: object) -> str:
    """A refused value for a message ("got …"): quoted when it is short, described by
    its size when it is not (a long string by its length: it may be a key; a huge
    integer by its digits: its ``repr`` would fill the message, or fail).  A value of
    any other type (bytes, a list that may hold a key) is quoted under the same
    length as a string.  The built-in methods are called, never a subclass's own."""
    try:
        if isinstance(value, bool) or value is None:
            return repr(value)
        if isinstance(value, int):
            if int.bit_length(value) > _INT_BITS_MAX:
                return f"a whole number of about {int(int.bit_length(value) * 0.30103) + 1} digits"
            return int.__repr__(value)
        if isinstance(value, float):
            return float.__repr__(value)
        if isinstance(value, str):
            size = str.__len__(value)
            return str.__repr__(value) if size <= QUOTE_MAX else f"a value of {size} characters (not shown)"
        text = repr(value)
        if isinstance(text, str) and str.__len__(text) <= QUOTE_MAX + 2:  # (+ its quotes or brackets)
            return str.__str__(text)
    except Exception:  # a caller's object whose repr or len fails is still refused, clearly
        pass
    return f"a {type(value).__name__} (not shown)"


@functools.lru_cache(maxsize=8)
def _forms(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """Every spelling of every secret a message could carry, longest first (``clip``
    reads the longest as the first, and each of the automaton's lists keeps the
    order)."""
    found: set[str] = set()
    for secret in secrets:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
            continue
        # The bytes as sent: a lone surrogate (a non-UTF-8 byte of an environment
        # value) is that byte again, never an error here (redacting must not fail).
        try:
            raw = secret.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that stands for no byte (U+D83D)
            raw = secret.encode("utf-8", "surrogatepass")
        found.add(secret)
        found.add(repr(secret)[1:-1])  # str repr: \x00, \\, \'
        found.add(repr(secret.encode("utf-8", "backslashreplace"))[2:-1])  # bytes repr (h11)
        found.add(json.dumps(secret)[1:-1])  # JSON, ASCII-escaped
        found.add(json.dumps(secret, ensure_ascii=False)[1:-1])
        found.add(quote(raw, safe=""))  # a URL's percent-encoding
        found.add(quote(raw))
        for digits in ("%%%02X", "%%%02x"):  # every byte percent-encoded, unreserved ones too
            found.add("".join(digits % byte for byte in raw))
        found.add(raw.hex())  # hex dumps
        found.add(raw.hex().upper())
        found.add(html.escape(secret))  # an HTML error page (&amp; &lt; &#x27;)
        found.add(html.escape(secret, quote=False))
        found.add(secret.lower())  # a header value compared case-insensitively
        found.add(secret.upper())
        found.update(_base64_forms(raw))
    return tuple(sorted((f for f in found if len(f) >= MIN_SECRET_LEN), key=len, reverse=True))


#: The shortest run of base64 text searched for: shorter ones would match by chance.
_MIN_BASE64 = 8


def _base64_forms(raw: bytes) -> set[str]:
    """The base64 text (standard and URL-safe alphabets) that ``raw`` becomes wherever
    it sits in what was encoded (``Basic base64(user:key)``): at each of the three
    byte alignments, the characters that only its own bytes decide."""
    forms: set[str] = set()
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + raw).decode("ascii")
        # Characters are 6 bits: the first ones also hold the bytes before it, the
        # last one (and the padding) the bytes after it.
        stable = encoded[(8 * offset + 5) // 6:(8 * (offset + len(raw))) // 6]
        if len(stable) >= _MIN_BASE64:
            forms.add(stable)
            forms.add(stable.replace("+", "-").replace("/", "_"))
    return forms


#: Above this many spellings, one pass of an Aho-Corasick automaton over the text
#: beats a search of the text for each spelling (each ~8 µs a 100 KB text, the
#: automaton's pass ~2 ms): a gateway with a thousand keys has ~10,000 spellings,
#: and searched one by one they held its loop for 0.6 s over a 100 KB prompt.
_AUTOMATON_FROM = 48
#: ... and over a text at least this long: a short one (an error message, the part of
#: one that is kept) is searched for each spelling, ~10 ms for the ~100,000 spellings
#: of ten thousand keys, where building their automaton takes ~0.3 s.
_AUTOMATON_TEXT = 4096
#: The automaton holds each spelling's last characters, not the whole of it: a
#: spelling's end is its secret's random end (keys share their start, "sk-proj-…",
#: and so do their hex, percent and base64 spellings), and a whole-spelling automaton
#: of ten thousand keys took 230 MB and 1.1 s to build, this one 17 MB and 0.3 s.
#: Each place the automaton finds is checked against the whole spellings.
_TAIL = 12


def _finder(secrets: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """The spellings of ``secrets``, longest first, and, when there are many, the key
    of the automaton that finds them."""
    same = _same(secrets)
    forms = _forms(same)
    return forms, (same if len(forms) >= _AUTOMATON_FROM else None)


@functools.lru_cache(maxsize=32)
def _same(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """The secrets as one sorted tuple, the key of their spellings: every source's
    tuple holds the same secrets in its own order, and they share one.  (Only the key
    is kept here; the spellings, megabytes for thousands of keys, are kept for the
    last few sets alone: see _forms.)"""
    return tuple(sorted({s for s in secrets if isinstance(s, str)}))


@functools.lru_cache(maxsize=4)
def _automaton(secrets: tuple[str, ...]) -> Any:
    """An automaton of the spellings' last :data:`_TAIL` characters, each with the
    spellings that end so, longest first.  Only a few are kept (the settings in force
    and the ones a reload replaced): a gateway whose reloads changed its keys kept one
    of tens of megabytes for every generation."""
    import ahocorasick  # (C)

    ends: dict[str, list[str]] = {}
    for form in _forms(secrets):  # (longest first: so is each list)
        ends.setdefault(form[-_TAIL:], []).append(form)
    automaton = ahocorasick.Automaton()
    for tail, forms in ends.items():
        automaton.add_word(tail, tuple(forms))
    automaton.make_automaton()
    return automaton


def _spans(text: str, forms: tuple[str, ...], key: tuple[str, ...] | None) -> list[tuple[int, int]]:
    """Where any spelling occurs in ``text``, overlapping occurrences included."""
    spans: list[tuple[int, int]] = []
    if key is not None and len(text) >= _AUTOMATON_TEXT:
        for end, ending in _automaton(key).iter(text):
            end += 1
            for form in ending:
                start = end - len(form)
                if start >= 0 and text.startswith(form, start):
                    spans.append((start, end))
        return spans
    for form in forms:
        at = text.find(form)
        while at >= 0:
            spans.append((at, at + len(form)))
            at = text.find(form, at + 1)
    return spans


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every form of every secret replaced by ``***``: each run of text
    covered by one or more occurrences (overlapping ones too) becomes one mask."""
    return _masked(text, *_finder(_key(secrets)))


def _masked(text: str, forms: tuple[str, ...], key: tuple[str, ...] | None) -> str:
    if not forms:
        return text
    spans = _spans(text, forms, key)
    if not spans:
        return text
    spans.sort()
    pieces: list[str] = []
    done = 0  # the text before this is written
    start, end = spans[0]
    for at, until in spans:
        if at < end:  # overlaps the run so far
            end = max(end, until)
            continue
        pieces += (text[done:start], MASK)
        done, start, end = end, at, until
    pieces += (text[done:start], MASK, text[end:])
    return "".join(pieces)


def clip(text: str, limit: int, secrets: Iterable[str] = (), *, cut: bool = False) -> str:
    """Redact, then shorten to ``limit`` characters (an ellipsis marks a cut).

    Only the part that can be kept is redacted: the first ``limit`` characters and as
    many more as the longest spelling of a secret, so that one that begins in the
    kept part is found whole.  An upstream's 64 KiB error message cut to 300
    characters costs 300 characters' work, not 64 KiB's.  A spelling that part cut
    short begins past ``limit``; the masks before it shortened the text by some
    characters and brought it that much nearer the front, so that many fewer are kept.

    A text that ends where it was cut (here, or earlier: ``cut=True`` says the text
    is an excerpt) may end in the first characters of a secret that no longer
    matches whole, so its last word goes too: the whole trailing run of visible ASCII
    characters (what a key and its spellings are made of).  Whatever that run holds,
    whether it begins a secret or not: a cut that dropped only the starts of secrets
    told a client who could place text at the cut (an upstream's 400 that echoes a
    value) whether its guess began one, a character at a time; and one that dropped
    as much as the longest secret's spelling told it that length.  (A run of other
    characters is a message's own words: a Chinese error text, without blanks, lost
    half its length to the drop.)  Without secrets nothing is dropped.
    """
    forms, key = _finder(_key(secrets))
    if forms:
        window = limit + len(forms[0])  # (the longest spelling comes first)
        if len(text) > window:
            masked = _masked(text[:window], forms, key)
            text, cut = masked[:max(0, limit - (window - len(masked)))], True
        else:
            text = _masked(text, forms, key)
    if len(text) > limit:
        text, cut = text[:limit], True
    if cut:
        text = (_drop_last_word(text) if forms else text) + "…"
    return text


def _drop_last_word(text: str) -> str:
    """``text`` without its trailing run of visible ASCII characters."""
    kept = len(text)
    while kept and "!" <= text[kept - 1] <= "~":
        kept -= 1
    return text[:kept]


def _key(secrets: Iterable[str]) -> tuple[str, ...]:
    return secrets if isinstance(secrets, tuple) else tuple(secrets)


#: Query (or fragment) parameters whose value is a credential (libpq's ``password``
#: and ``sslpassword``, a Redis URL's ``password``, an ``api_key`` or ``token``, a
#: signed link's ``sig``, ``X-Amz-Signature``, ``X-Goog-Credential``, an OAuth
#: ``#access_token``...).
SECRET_PARAM = re.compile(
    r"(?P<lead>[?&;#](?P<name>[^=&#;]*(?:pass|secret|token|key|auth|sig|credential)[^=&#;]*)=)"
    r"(?P<value>[^&#;]*)",
    re.IGNORECASE,
)


#: A credential in libpq's ``key=value`` connection string (``host=db password=x``;
#: a value may be single-quoted, with backslash escapes): not a URL, but given where
#: one is expected (``polygate stats --db``) it is shown masked all the same.
DSN_SECRET_PARAM = re.compile(
    r"(?P<lead>(?:^|\s)[a-z_]*(?:pass|secret|token|key|auth)[a-z_]*\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'?|\S*)",
    re.IGNORECASE,
)


def query_secrets(url: str) -> list[str]:
    """The values of a URL's credential-like query parameters (see SECRET_PARAM), as
    written and percent-decoded."""
    found: list[str] = []
    for match in SECRET_PARAM.finditer(url):
        value = match.group("value")
        found += [value, unquote(value)]
    return found


def url_secrets(url: str) -> tuple[str, ...]:
    """The credentials a URL carries, harvested from the raw text: everything
    between ``://`` and the *last* ``@``, its password part, and the password
    percent-decoded (what the server actually checks).

    No parser is asked: an unencoded ``#``, ``/`` or ``?`` in a password makes
    ``urlsplit`` end the authority early and find no password at all.  A user name
    alone (no ``:``) is not a secret.
    """
    if not isinstance(url, str):
        return ()
    found = query_secrets(url)
    _, sep, rest = url.partition("://")
    userinfo, at, _ = rest.rpartition("@")
    if sep and at and ":" in userinfo:
        password = userinfo.split(":", 1)[1]
        found += [userinfo, password, unquote(password)]
        # An unencoded "@" in the password (refused as a setting; polygate stats --db
        # takes any URL): a parser that splits at the first "@" reads the rest as the
        # host and quotes it in its errors.
        found += userinfo.split("@")
        found += password.split("@")
    return tuple(dict.fromkeys(s for s in found if len(s) >= MIN_SECRET_LEN))


#: A configuration message about a URL masks any run of this many characters or more
#: that begins its password, whether the run came from the password or not.
PREFIX_RUN = 6


def mask_prefixes(text: str, secrets: Iterable[str]) -> str:
    """``text`` with the secrets redacted, and any run that begins like one of them
    (:data:`PREFIX_RUN` characters or more) masked too.

    Used for messages about a URL holding a password: a parser that stops early (an
    unencoded ``#`` in the password) quotes the password's start, and a message is
    not worth showing even a coincidental start of it ("Source…" for a password
    "Source1!").  The message may read oddly then; it never helps a reader rebuild
    the password."""
    text = redact(text, secrets)
    for secret in _key(secrets):
        for n in range(len(secret), PREFIX_RUN - 1, -1):
            start = secret[:n]
            if start in text:
                text = text.replace(start, MASK)
    return text


#: Redis's refusal of a command it does not know quotes the command's first arguments
#: ("unknown command 'HELLO', with args beginning with: '3' 'AUTH' 'user' 'pass…' ";
#: before 6 with backquotes and commas), cut at 128 characters, up to the next
#: error in polygate's chain (`` <- ``) or the end.
_QUOTED_ARGS = re.compile(r"(with args beginning with:).*?(?= <- |$)", re.S)


def masked(text: str, password: str) -> str:
    """A server's error text with ``password`` masked however the server quoted it:
    whole, with its line breaks made spaces, or among an unknown command's arguments.
    A Redis without ``HELLO`` (before 6, or a proxy) answers the client's
    ``HELLO 3 AUTH user password`` by quoting its arguments cut at 128 characters
    with CR and LF made spaces: a long password's first 109 characters were shown, and
    after a long user name its first few, whatever a mask of the password's starts
    (which also shows where the server's own words begin like the password) can do.
    Those arguments are not shown at all."""
    text = _QUOTED_ARGS.sub(r"\1 (not shown)", text)
    spaced = password.replace("\r", " ").replace("\n", " ")
    for form in {password, spaced}:  # (whole, however short)
        text = text.replace(form, MASK)
    return text


_E = TypeVar("_E", bound=BaseException)


def frameless(
    error: _E, *, handled: BaseException | None,
    spare: Callable[[BaseException], bool] | None = None,
) -> _E:
    """``error``, and the exceptions chained to it (cause, context, a group's members),
    without the frames they were raised through: raise it again and its traceback
    starts where it is raised.  ``handled`` is the exception the caller was handling
    when polygate was called (``sys.exc_info()[1]`` on the way in): the chain is the
    caller's from there on, and stays as it is (its frames are the caller's own).
    A group's member that ``spare`` picks keeps its frames, and what is chained to it
    (a bug in a sibling branch: where it happened is what its reader needs).

    A crash reporter records each frame's locals (Sentry does by default, and so does
    ``traceback.TracebackException(capture_locals=True)``): the frames that read an
    upstream's body that echoed a key, or that opened a URL with its password, hold
    them under names (``payload``, ``url``, a driver's ``creds``) no scrubber knows.
    The message already says what went wrong, with the secrets redacted; the frames
    add nothing a caller could act on."""
    seen: set[int] = set() if handled is None else {id(handled)}
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        exc.__traceback__ = None
        todo += [exc.__cause__, exc.__context__]
        if isinstance(exc, BaseExceptionGroup):
            todo += exc.exceptions if spare is None else [
                member for member in exc.exceptions if not spare(member)]
    return error


_P = ParamSpec("_P")
_R = TypeVar("_R")


def frameless_on(
    *kinds: type[BaseException],
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator: the errors of ``kinds`` the function raises leave it
    :func:`frameless`, raised from a frame that holds nothing of its arguments.  For the
    ways configuration is read and built: their frames hold the environment (all of
    ``os.environ``), a TOML file's tables, a constructor's arguments, keys and
    passwords among them, and a configuration error is what a crash reporter sees at
    start-up.  (Bugs, any other kind, keep their frames.)"""

    def decorate(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            handled = sys.exc_info()[1]
            try:
                return fn(*args, **kwargs)
            except kinds as exc:
                del args, kwargs
                raise frameless(exc, handled=handled)  # noqa: B904 (the same error)

        return wrapper

    return decorate
