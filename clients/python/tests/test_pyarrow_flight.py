"""The real pyarrow Flight client against the real server binary, standard library only.

The server runs over a simulated CDC database whose workload journals every change row it
commits; the test lists the tables, plans a range, reads every endpoint (checking each
stream's completion marker) and compares the rows with the journal.
"""

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from conftest import change_rows, journal_rows


def action(client, name, body):
    results = list(client.do_action(flight.Action(name, json.dumps(body).encode())))
    assert len(results) == 1
    return json.loads(results[0].body.to_pybytes())


def read_endpoint(client, endpoint, options=None):
    """Returns the endpoint's batches and its completion marker (None if it never came).

    The marker is the app_metadata of the stream's last batch, which has no rows.
    """
    reader = client.do_get(endpoint.ticket, options)
    batches, marker = [], None
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            break
        assert marker is None, "data after the completion marker"
        if chunk.app_metadata is not None:
            assert chunk.data is not None and chunk.data.num_rows == 0
            marker = json.loads(chunk.app_metadata.to_pybytes())
        elif chunk.data is not None:
            batches.append(chunk.data)
    return batches, marker


def test_lists_the_tracked_tables(server):
    client = flight.FlightClient(server)
    infos = list(client.list_flights())
    tables = sorted(json.loads(info.descriptor.command)["table"] for info in infos)
    assert tables == ["dbo.customers", "dbo.orders"]
    orders = next(info for info in infos if b"dbo.orders" in info.descriptor.command)
    metadata = json.loads(orders.app_metadata)
    assert orders.schema.names[:6] == [
        "_capture_instance",
        "_start_lsn",
        "_seqval",
        "_operation",
        "_command_id",
        "_commit_ts",
    ]
    assert orders.schema.field("amount").type == pa.decimal128(19, 4)
    assert orders.schema.field("_commit_ts").type == pa.timestamp("us")
    assert metadata["capture_instances"][0]["name"] == "dbo_orders"
    assert metadata["capture_instances"][0]["index_columns"] == ["order_id"]


def test_plans_and_reads_every_endpoint_as_committed(server, database):
    _, journal = database
    client = flight.FlightClient(server)
    start = action(client, "initial_offset", {"table": "dbo.orders", "starting": "earliest"})
    end = action(client, "latest_offset", {"start": start})
    assert end["lsn"] > start["lsn"] and end["commit_ts"]
    command = {
        "type": "changes",
        "table": "dbo.orders",
        "from": start["lsn"],
        "to": end["lsn"],
        "partitions": 3,
        "min_partition_rows": 50,
    }
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
    assert len(info.endpoints) == 3
    batches = []
    for endpoint in info.endpoints:
        endpoint_batches, marker = read_endpoint(client, endpoint)
        assert marker is not None, "every stream ends with its completion marker"
        assert marker["type"] == "complete"
        assert marker["rows"] == sum(batch.num_rows for batch in endpoint_batches)
        batches.extend(endpoint_batches)
    table = pa.Table.from_batches(batches, schema=info.schema)
    assert table.num_rows == info.total_records
    streamed = change_rows(table)
    expected = journal_rows(journal, "dbo.orders")
    assert len(expected) > 300
    assert streamed == expected
    assert set(table.column("_operation").to_pylist()) <= {1, 2, 3, 4}
    # pyarrow's stock read_all takes the marker as an empty batch: the same rows.
    whole = pa.concat_tables(client.do_get(e.ticket).read_all() for e in info.endpoints)
    assert whole.num_rows == table.num_rows


def test_bad_requests_get_actionable_errors(server):
    client = flight.FlightClient(server)
    with pytest.raises(pa.ArrowInvalid, match="partitons"):
        bad = {"type": "changes", "table": "dbo.orders", "from": "0x00", "partitons": 2}
        client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(bad)))
    with pytest.raises(pa.ArrowException, match="dbo.nope"):
        missing = {"type": "changes", "table": "dbo.nope", "from": "0x00"}
        client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(missing)))


def test_a_tampered_ticket_is_refused(server):
    client = flight.FlightClient(server)
    start = action(client, "initial_offset", {"table": "dbo.customers"})
    command = {"type": "changes", "table": "dbo.customers", "from": start["lsn"]}
    info = client.get_flight_info(flight.FlightDescriptor.for_command(json.dumps(command)))
    ticket = bytearray(info.endpoints[0].ticket.ticket)
    ticket[len(ticket) // 2] ^= 0x01
    with pytest.raises(flight.FlightUnauthorizedError, match="signature"):
        client.do_get(flight.Ticket(bytes(ticket))).read_all()
