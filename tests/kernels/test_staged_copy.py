"""Staged host->device copies: values, bounds, and the no-reuse-while-in-flight rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.runtime.staged_copy import CpuGpuBuffer, PackedCpuGpuBuffer, stage_to_device


class RecordingFence:
    """Stands in for a CUDA event, which cannot exist without a GPU: logs record/synchronize."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_copy_to_gpu_copies_the_first_rows(device) -> None:  # type: ignore[no-untyped-def]
    buf = CpuGpuBuffer(8, 3, dtype=torch.int64, device=device)
    buf.cpu[:5] = torch.arange(15).reshape(5, 3)
    out = buf.copy_to_gpu(5)
    assert out.device.type == device.type and out.shape == (5, 3)
    assert torch.equal(out.cpu(), torch.arange(15).reshape(5, 3))
    assert torch.equal(buf.gpu[5:].cpu(), torch.zeros(3, 3, dtype=torch.int64))
    assert buf.gpu.data_ptr() != buf.cpu.data_ptr()  # two buffers even on a CPU-only machine


def test_host_side_writes_after_a_copy_do_not_reach_the_device(device) -> None:  # type: ignore[no-untyped-def]
    """Writing `.cpu` right after copy_to_gpu must not change what the device received."""
    buf = CpuGpuBuffer(1 << 20, dtype=torch.float32, device=device)
    buf.np[:] = 1.0
    out = buf.copy_to_gpu()
    buf.cpu.fill_(2.0)  # waits for the copy before handing out the host memory
    assert bool((out == 1.0).all())


def test_host_access_waits_for_the_copy_in_flight() -> None:
    log: list[str] = []
    buf = CpuGpuBuffer(4, dtype=torch.int32, device="cpu", fence=RecordingFence(log))
    buf.cpu[:] = 1
    assert log == []  # nothing in flight yet: no wait
    buf.copy_to_gpu(2)
    assert log == ["record"]
    _ = buf.cpu
    assert log == ["record", "synchronize"]
    _ = buf.cpu
    assert log == ["record", "synchronize"]  # waited once; the copy is done


def test_copy_bounds() -> None:
    buf = CpuGpuBuffer(4, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match=r"copy_to_gpu\(n=5\) outside the buffer's 4 rows"):
        buf.copy_to_gpu(5)
    assert buf.copy_to_gpu(0).shape == (0,)


def test_stage_to_device(device) -> None:  # type: ignore[no-untyped-def]
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]  # non-contiguous source
    out = stage_to_device(arr, device)
    assert out.device.type == device.type
    assert torch.equal(out.cpu(), torch.from_numpy(np.ascontiguousarray(arr)))
    src = torch.arange(6)
    copy = stage_to_device(src, device)
    src[0] = 99  # the result is a copy, not a view of the source
    assert int(copy[0]) == 0


def test_stage_to_device_rejects_device_sources() -> None:
    with pytest.raises(ValueError, match="copies from host memory"):
        stage_to_device(torch.zeros(2, device="meta"), "cpu")
    with pytest.raises(TypeError, match="takes a tensor or ndarray"):
        stage_to_device([1, 2], "cpu")  # type: ignore[arg-type]


def _packed(device: torch.device | str, fence: RecordingFence | None = None) -> PackedCpuGpuBuffer:
    return PackedCpuGpuBuffer(
        {
            "ids": ((4,), torch.int64),
            "lens": ((3,), torch.int32),  # 12 bytes: the next field starts aligned anyway
            "tables": ((4, 5), torch.int32),
        },
        device=device,
        fence=fence,
    )


def test_packed_fields_arrive_in_one_copy(device) -> None:  # type: ignore[no-untyped-def]
    buf = _packed(device)
    host = buf.host()
    host["ids"][:] = [7, 8, 9, 10]
    host["lens"][:] = [1, 2, 3]
    host["tables"][:] = np.arange(20).reshape(4, 5)
    buf.copy_to_gpu(buf.end("tables", 2))  # the tables' first two rows, every field before
    assert buf.gpu["ids"].tolist() == [7, 8, 9, 10]
    assert buf.gpu["lens"].dtype == torch.int32 and buf.gpu["lens"].tolist() == [1, 2, 3]
    assert buf.gpu["tables"].shape == (4, 5)
    assert buf.gpu["tables"][:2].tolist() == np.arange(10).reshape(2, 5).tolist()
    assert buf.gpu["tables"][2:].abs().sum().item() == 0  # rows past `end` were not copied
    for name, t in buf.gpu.items():  # typed views of one device allocation, aligned
        assert t.data_ptr() % PackedCpuGpuBuffer.ALIGN == 0, name
        assert t.untyped_storage().data_ptr() == buf.gpu["ids"].untyped_storage().data_ptr()


def test_packed_host_waits_for_the_copy_in_flight() -> None:
    log: list[str] = []
    buf = _packed("cpu", RecordingFence(log))
    buf.host()["ids"][:] = 1
    buf.copy_to_gpu(buf.end("ids", 4))
    assert log == ["record"]
    host = buf.host()  # every field shares the one fence
    assert log == ["record", "synchronize"]
    # the same arrays every step (made once), still writing through to the next copy
    assert all(a is b for a, b in zip(host.values(), buf.host().values(), strict=True))
    host["ids"][:] = 5
    buf.copy_to_gpu(buf.end("ids", 4))
    assert buf.gpu["ids"].tolist() == [5, 5, 5, 5]


def test_packed_end_bounds() -> None:
    buf = _packed("cpu")
    assert buf.end("ids", 0) == 0 and buf.end("ids", 4) == 32
    assert buf.end("lens", 3) == 32 + 12
    assert buf.end("tables", 1) == 48 + 20  # lens padded to 48
    with pytest.raises(ValueError, match="tables has 4 rows, not 5"):
        buf.end("tables", 5)
