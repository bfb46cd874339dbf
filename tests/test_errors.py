"""How remote errors are summarised for users: the cause, in one line."""

from __future__ import annotations

from fedprivacy.errors import InputError, error_summary

# What a ClientApp exception looks like when Ray carries it to the server (shortened from a real
# run): the cause's traceback, then Flower's wrapper, with ANSI colour codes.
RAY_REASON = (
    "Traceback (most recent call last):\n"
    '  File "/x/fedprivacy/data/tables.py", line 22, in read_table\n'
    '    raise InputError("data-path", str(path), "no such file")\n'
    "fedprivacy.errors.InputError: data-path='/tmp/x.csv': no such file\n\n"
    "The above exception was the direct cause of the following exception:\n\n"
    "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=7024, ip=192.0.2.2)\n"
    '  File "/x/flwr/simulation/ray_transport/ray_actor.py", line 65, in run\n'
    "    raise ClientAppException(str(ex)) from ex\n"
    "flwr.clientapp.client_app.ClientAppException: \n"
    "Exception ClientAppException occurred. Message: data-path='/tmp/x.csv': no such file'>"
)


def test_the_cause_of_a_ray_client_error_is_its_summary():
    assert error_summary(RAY_REASON) == "InputError: data-path='/tmp/x.csv': no such file"


def test_an_in_process_reason_is_kept_as_it_is():
    reason = f"InputError: {InputError('epsilon', -1, 'must be a finite number > 0')}"
    assert error_summary(reason) == "InputError: epsilon=-1: must be a finite number > 0"


def test_a_reason_without_an_exception_line_gives_its_last_line():
    assert error_summary("connection lost\n  while sending\n") == "while sending"
    assert error_summary("  \n") == "unknown error"


def test_a_deployed_supernodes_reason_gives_the_exception_and_its_message():
    """Flower's SuperNode sends `str(type(ex)) + ":<'" + str(ex) + "'>"`."""
    refusal = "client a: plan over budget: ε=1.2 > 1"
    reason = str(type(RuntimeError())).replace("builtins.", "") + ":<'" + refusal + "'>"
    assert error_summary(reason) == f"RuntimeError: {refusal}"
    nested = "<class 'fedprivacy.errors.ClientRefusal'>:<'the server's model does not fit (a: [1, 2])'>"
    assert error_summary(nested) == "ClientRefusal: the server's model does not fit (a: [1, 2])"
