"""Which Vulkan devices this process sees, and the extensions Arm's VGF delegate needs.

Run as a script's source in a fresh interpreter (``python -c``) by
:mod:`graphbuild.targets.executorch.vulkan`, with the environment (layer paths) under test: a
Vulkan loader or driver that crashes takes the probe down, never the export. It imports the
standard library only, so it starts in a fraction of a second, and prints one JSON line::

    {"loader": true, "devices": [{"name": "llvmpipe ...", "extensions": ["VK_ARM_tensors"]}]}

``loader`` is false when ``libvulkan.so.1`` (``vulkan-1.dll``, ``libvulkan.1.dylib``) does
not load; ``error`` names a failing Vulkan call.
"""

from __future__ import annotations

import ctypes
import json
import sys

#: the device extensions the VGF delegate of ExecuTorch 1.4 needs
ML_EXTENSIONS = ("VK_ARM_tensors", "VK_ARM_data_graph")

_LOADERS = {"win32": "vulkan-1.dll", "darwin": "libvulkan.1.dylib"}
_API_1_3 = (1 << 22) | (3 << 12)


class _AppInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("pApplicationName", ctypes.c_char_p),
        ("applicationVersion", ctypes.c_uint32),
        ("pEngineName", ctypes.c_char_p),
        ("engineVersion", ctypes.c_uint32),
        ("apiVersion", ctypes.c_uint32),
    ]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("pApplicationInfo", ctypes.POINTER(_AppInfo)),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.c_void_p),
    ]


class _QueueInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("queueFamilyIndex", ctypes.c_uint32),
        ("queueCount", ctypes.c_uint32),
        ("pQueuePriorities", ctypes.POINTER(ctypes.c_float)),
    ]


class _DeviceInfo(ctypes.Structure):
    _fields_ = [
        ("sType", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("queueCreateInfoCount", ctypes.c_uint32),
        ("pQueueCreateInfos", ctypes.POINTER(_QueueInfo)),
        ("enabledLayerCount", ctypes.c_uint32),
        ("ppEnabledLayerNames", ctypes.c_void_p),
        ("enabledExtensionCount", ctypes.c_uint32),
        ("ppEnabledExtensionNames", ctypes.POINTER(ctypes.c_char_p)),
        ("pEnabledFeatures", ctypes.c_void_p),
    ]


class _ExtensionProperties(ctypes.Structure):
    _fields_ = [("extensionName", ctypes.c_char * 256), ("specVersion", ctypes.c_uint32)]


def probe() -> dict:
    """The loader's presence and each physical device's name and ML extensions."""
    try:
        vk = ctypes.CDLL(_LOADERS.get(sys.platform, "libvulkan.so.1"))
    except OSError as err:
        return {"loader": False, "devices": [], "error": str(err)}
    app = _AppInfo(0, None, b"graphbuild-probe", 1, b"graphbuild", 1, _API_1_3)
    info = _InstanceInfo(1, None, 0, ctypes.pointer(app), 0, None, 0, None)
    instance = ctypes.c_void_p()
    result = vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance))
    if result != 0:
        return {"loader": True, "devices": [], "error": f"vkCreateInstance returned {result}"}
    try:
        count = ctypes.c_uint32()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        return {"loader": True, "devices": [_device(vk, h) for h in handles[: count.value]]}
    finally:
        vk.vkDestroyInstance(instance, None)


def _device(vk: ctypes.CDLL, handle: int) -> dict:
    # VkPhysicalDeviceProperties: five uint32 fields, then deviceName[256] (the whole struct
    # is under 1 KiB; the buffer is larger so no driver writes past it)
    properties = ctypes.create_string_buffer(4096)
    vk.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), properties)
    name = properties.raw[20:276].split(b"\0", 1)[0].decode(errors="replace")
    count = ctypes.c_uint32()
    device = ctypes.c_void_p(handle)
    vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), None)
    extensions = (_ExtensionProperties * count.value)()
    vk.vkEnumerateDeviceExtensionProperties(device, None, ctypes.byref(count), extensions)
    names = {e.extensionName.decode(errors="replace") for e in extensions[: count.value]}
    found = sorted(names & set(ML_EXTENSIONS))
    row: dict = {"name": name, "extensions": found}
    if len(found) == len(ML_EXTENSIONS):
        row["create_device"] = _create_device(vk, device)
    return row


def _create_device(vk: ctypes.CDLL, device: ctypes.c_void_p) -> int:
    """vkCreateDevice's result with the ML extensions enabled on queue family 0: a layer
    that lists an extension it cannot serve (the emulation layers in the wrong order) fails
    here, as it would under ExecuTorch's delegate."""
    priority = ctypes.c_float(1.0)
    queue = _QueueInfo(2, None, 0, 0, 1, ctypes.pointer(priority))
    names = (ctypes.c_char_p * len(ML_EXTENSIONS))(*(n.encode() for n in ML_EXTENSIONS))
    info = _DeviceInfo(3, None, 0, 1, ctypes.pointer(queue), 0, None, len(names), names, None)
    handle = ctypes.c_void_p()
    result = vk.vkCreateDevice(device, ctypes.byref(info), None, ctypes.byref(handle))
    if result == 0:
        vk.vkDestroyDevice(handle, None)
    return int(result)


if __name__ == "__main__":
    print(json.dumps(probe()))
