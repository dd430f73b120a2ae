"""Each Vulkan physical device's identity and memory, read from Vulkan's own properties (the loader,
libvulkan, through ctypes): wgpu reports neither a device UUID nor memory sizes.

The UUID (VkPhysicalDeviceIDProperties.deviceUUID) is what pairs a Vulkan adapter with the same card seen
through CUDA: NVIDIA's Vulkan driver gives the card the UUID NVML and the CUDA runtime give it, so one card is
counted once whatever order the two APIs enumerate it in. Memory is the device-local heaps' size and, where
the driver has VK_EXT_memory_budget, the budget left to this process. Any failure (no loader, no driver, an
old loader without Vulkan 1.1) gives no cards: detection never fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from functools import lru_cache

API_1_1 = (1 << 22) | (1 << 12)
"""VK_MAKE_API_VERSION(0, 1, 1, 0): the properties2 queries and the ID properties are core in 1.1."""

# VkStructureType values (vulkan_core.h)
_APPLICATION_INFO = 0
_INSTANCE_CREATE_INFO = 1
_PROPERTIES_2 = 1000059001
_MEMORY_PROPERTIES_2 = 1000059006
_ID_PROPERTIES = 1000071004
_MEMORY_BUDGET = 1000237000
_HEAP_DEVICE_LOCAL = 0x1
_MAX_HEAPS = 16
BUDGET_EXTENSION = b"VK_EXT_memory_budget"

DEVICE_TYPES = ("other", "integrated", "discrete", "virtual", "cpu")
"""VkPhysicalDeviceType by value."""


class _ApplicationInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", ctypes.c_uint32), ("pEngineName", ctypes.c_char_p),
                ("engineVersion", ctypes.c_uint32), ("apiVersion", ctypes.c_uint32)]


class _InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.POINTER(_ApplicationInfo)), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


class _DeviceProperties(ctypes.Structure):
    """The head of VkPhysicalDeviceProperties (what is read here), padded past the whole struct's size
    (824 bytes on 64-bit: the limits and sparse properties that follow are not read)."""
    _fields_ = [("apiVersion", ctypes.c_uint32), ("driverVersion", ctypes.c_uint32),
                ("vendorID", ctypes.c_uint32), ("deviceID", ctypes.c_uint32), ("deviceType", ctypes.c_uint32),
                ("deviceName", ctypes.c_char * 256), ("pipelineCacheUUID", ctypes.c_uint8 * 16),
                ("rest", ctypes.c_uint64 * 160)]


class _Properties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("properties", _DeviceProperties)]


class _IdProperties(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("deviceUUID", ctypes.c_uint8 * 16),
                ("driverUUID", ctypes.c_uint8 * 16), ("deviceLUID", ctypes.c_uint8 * 8),
                ("deviceNodeMask", ctypes.c_uint32), ("deviceLUIDValid", ctypes.c_uint32)]


class _MemoryType(ctypes.Structure):
    _fields_ = [("propertyFlags", ctypes.c_uint32), ("heapIndex", ctypes.c_uint32)]


class _MemoryHeap(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("flags", ctypes.c_uint32)]


class _MemoryProperties(ctypes.Structure):
    _fields_ = [("memoryTypeCount", ctypes.c_uint32), ("memoryTypes", _MemoryType * 32),
                ("memoryHeapCount", ctypes.c_uint32), ("memoryHeaps", _MemoryHeap * _MAX_HEAPS)]


class _MemoryProperties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p), ("memoryProperties", _MemoryProperties)]


class _MemoryBudget(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_uint32), ("pNext", ctypes.c_void_p),
                ("heapBudget", ctypes.c_uint64 * _MAX_HEAPS), ("heapUsage", ctypes.c_uint64 * _MAX_HEAPS)]


class _ExtensionProperties(ctypes.Structure):
    _fields_ = [("extensionName", ctypes.c_char * 256), ("specVersion", ctypes.c_uint32)]


@dataclass(frozen=True)
class VulkanCard:
    """One Vulkan physical device as Vulkan describes it."""

    pci_id: int
    """(deviceID << 16) | vendorID, as the inventory pairs views."""
    name: str
    uuid: str
    """deviceUUID as 8-4-4-4-12 lowercase hex (NVML's UUID without its `GPU-` prefix, on NVIDIA)."""
    device_type: str
    local_bytes: int
    """The device-local heaps' size together."""
    budget_bytes: int | None
    """VK_EXT_memory_budget's budget over those heaps less their current usage; None without the extension."""


def uuid_text(raw: bytes) -> str:
    """16 bytes as 8-4-4-4-12 lowercase hex."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@lru_cache(maxsize=None)
def vulkan_cards() -> tuple[VulkanCard, ...]:
    """Every physical device in the loader's order, read once per process; () where Vulkan is unavailable."""
    name = ctypes.util.find_library("vulkan") or "libvulkan.so.1"
    try:
        vk = ctypes.CDLL(name)
        return tuple(_read_cards(vk))
    except (OSError, AttributeError):
        return ()


def _read_cards(vk) -> list[VulkanCard]:
    app = _ApplicationInfo(_APPLICATION_INFO, None, b"jitllm", 0, b"jitllm", 0, API_1_1)
    create = _InstanceCreateInfo(_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    if vk.vkCreateInstance(ctypes.byref(create), None, ctypes.byref(instance)) != 0:
        return []
    try:
        count = ctypes.c_uint32()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != 0:
            return []
        devices = (ctypes.c_void_p * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), devices) not in (0, 5):  # 5: VK_INCOMPLETE
            return []
        return [_card(vk, ctypes.c_void_p(d)) for d in devices[:count.value]]
    finally:
        vk.vkDestroyInstance(instance, None)


def _card(vk, device) -> VulkanCard:
    ids = _IdProperties(_ID_PROPERTIES, None)
    props = _Properties2(_PROPERTIES_2, ctypes.cast(ctypes.pointer(ids), ctypes.c_void_p))
    vk.vkGetPhysicalDeviceProperties2(device, ctypes.byref(props))
    p = props.properties
    budget = _MemoryBudget(_MEMORY_BUDGET, None)
    has_budget = BUDGET_EXTENSION in _extensions(vk, device)
    memory = _MemoryProperties2(_MEMORY_PROPERTIES_2, ctypes.cast(ctypes.pointer(budget), ctypes.c_void_p)
                                if has_budget else None)
    vk.vkGetPhysicalDeviceMemoryProperties2(device, ctypes.byref(memory))
    heaps = memory.memoryProperties
    local = [i for i in range(min(heaps.memoryHeapCount, _MAX_HEAPS)) if heaps.memoryHeaps[i].flags & _HEAP_DEVICE_LOCAL]
    return VulkanCard(
        pci_id=(p.deviceID << 16) | p.vendorID,
        name=p.deviceName.decode(errors="replace"),
        uuid=uuid_text(bytes(ids.deviceUUID)),
        device_type=DEVICE_TYPES[p.deviceType] if p.deviceType < len(DEVICE_TYPES) else "other",
        local_bytes=sum(heaps.memoryHeaps[i].size for i in local),
        budget_bytes=sum(max(0, budget.heapBudget[i] - budget.heapUsage[i]) for i in local) if has_budget else None,
    )


def _extensions(vk, device) -> set[bytes]:
    count = ctypes.c_uint32()
    if vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), None) != 0:
        return set()
    found = (_ExtensionProperties * count.value)()
    if vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), found) not in (0, 5):
        return set()
    return {e.extensionName for e in found[:count.value]}
