{{- define "prefixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
RayService name. KubeRay derives "<name>-serve-svc", "<name>-head-svc" and
"<name>-raycluster-<id>-..." pod names from it, so it stays well under 63 characters.
*/}}
{{- define "prefixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "prefixserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "prefixserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "prefixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "prefixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "prefixserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "prefixserve.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "prefixserve.fullname" .)) }}
{{- end }}

{{/* Where engine.model points: "" leaves EngineConfig's default model. */}}
{{- define "prefixserve.modelPath" -}}
{{- $model := .Values.model }}
{{- if eq $model.source "image" }}
{{- $model.path }}
{{- else if eq $model.source "pvc" }}
{{- $_ := required "model.pvc.claimName is required when model.source is pvc" $model.pvc.claimName }}
{{- if $model.path }}{{ printf "%s/%s" $model.mountPath $model.path }}{{ else }}{{ $model.mountPath }}{{ end }}
{{- else if eq $model.source "uri" }}
{{- $uri := required "model.uri is required when model.source is uri" $model.uri }}
{{- printf "%s/%s" $model.mountPath ($model.path | default (base $uri)) }}
{{- end }}
{{- end }}

{{/*
A replica's ranks on one node (placement_strategy STRICT_PACK) need a worker group whose pods hold all the
replica's GPUs (serve.args.replica_num_gpus: tensor_parallel_size of them for one GPU per rank).
*/}}
{{- define "prefixserve.checkReplicaFitsAPod" -}}
{{- $args := .Values.serve.args }}
{{- $gpus := float64 ($args.replica_num_gpus | default 0) }}
{{- if and (gt $gpus 0.0) (eq ($args.placement_strategy | default "STRICT_PACK") "STRICT_PACK") }}
{{- $most := 0.0 }}
{{- range .Values.workerGroups }}
{{- $most = maxf $most (float64 (index ((.resources | default dict).limits | default dict) "nvidia.com/gpu" | default 0)) }}
{{- end }}
{{- if gt $gpus $most }}
{{- fail (printf "a replica takes %v GPUs on one node (serve.args.replica_num_gpus, placement_strategy STRICT_PACK), but no worker group's pods have more than %v nvidia.com/gpu" $gpus $most) }}
{{- end }}
{{- end }}
{{- end }}

{{/* serveConfigV2: the application `prefixserve serve` runs, args = ClusterConfig. */}}
{{- define "prefixserve.serveConfig" -}}
{{- include "prefixserve.checkReplicaFitsAPod" . }}
{{- $args := deepCopy .Values.serve.args }}
{{- $modelPath := include "prefixserve.modelPath" . }}
{{- if $modelPath }}
{{- $_ := set $args "engine" (merge (dict "model" $modelPath) ($args.engine | default dict)) }}
{{- end }}
{{- $app := dict "name" .Values.serve.applicationName "route_prefix" .Values.serve.routePrefix "import_path" "cluster.app:build_app" "args" $args }}
{{- with .Values.serve.runtimeEnv }}
{{- $_ := set $app "runtime_env" . }}
{{- end }}
{{- with .Values.serve.deployments }}
{{- $_ := set $app "deployments" . }}
{{- end }}
{{- toYaml (dict "applications" (list $app)) }}
{{- end }}

{{/* `ray start` parameters: KubeRay wants a map of strings. */}}
{{- define "prefixserve.rayStartParams" -}}
{{- $params := dict }}
{{- range $param, $value := . }}
{{- $_ := set $params $param (toString $value) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/*
Pod template of a Ray node. Takes (dict "root" $ "group" <head or worker group values> "node" "head"|"worker").
*/}}
{{- define "prefixserve.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $model := $root.Values.model -}}
metadata:
  labels:
    {{- include "prefixserve.selectorLabels" $root | nindent 4 }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if eq $model.source "uri" }}
  initContainers:
    - name: download-model
      image: {{ $model.download.image }}
      command:
        - sh
        - -c
        - test -s "$MODEL_FILE" || { curl -fL --retry 5 -o "$MODEL_FILE.part" "$MODEL_URI" && mv "$MODEL_FILE.part" "$MODEL_FILE"; }
      env:
        - name: MODEL_URI
          value: {{ $model.uri | quote }}
        - name: MODEL_FILE
          value: {{ include "prefixserve.modelPath" $root | quote }}
      volumeMounts:
        - name: model
          mountPath: {{ $model.mountPath }}
  {{- end }}
  containers:
    - name: ray-{{ .node }}
      image: {{ include "prefixserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- if eq .node "head" }}
        - {containerPort: 6379, name: gcs-server}
        - {containerPort: 8265, name: dashboard}
        - {containerPort: 10001, name: client}
        {{- end }}
        - {containerPort: 8000, name: serve}
        - {containerPort: 8080, name: metrics}
      {{- $direct := eq $root.Values.serve.args.front_door "direct" }}
      {{- if or $root.Values.apiKey.existingSecret $root.Values.apiKey.value $root.Values.extraEnv $direct }}
      env:
        {{- if $direct }}
        {{- /* Serve reads these when it is imported, in every Ray process (cluster/direct_ingress.py) */}}
        - {name: RAY_SERVE_ENABLE_HA_PROXY, value: "1"}
        - {name: RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY, value: "1"}
        - {name: RAY_SERVE_SESSION_ID_HEADER_KEY, value: x-session-id}
        - {name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, value: "0"}
        - {name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP, value: "0"}
        {{- end }}
        {{- if or $root.Values.apiKey.existingSecret $root.Values.apiKey.value }}
        - name: PREFIXSERVE_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ include "prefixserve.apiKeySecret" $root }}
              key: {{ $root.Values.apiKey.secretKey }}
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with $group.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if eq .node "worker" }}
      {{- with $root.Values.workerProbes.readiness }}
      readinessProbe:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.workerProbes.liveness }}
      livenessProbe:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- end }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        {{- if ne $model.source "image" }}
        - name: model
          mountPath: {{ $model.mountPath }}
          readOnly: true
          {{- with and (eq $model.source "pvc") $model.pvc.subPath }}
          subPath: {{ . }}
          {{- end }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.shmSizeLimit }}
    {{- if eq $model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $model.pvc.claimName }}
        readOnly: true
    {{- else if eq $model.source "uri" }}
    - name: model
      emptyDir:
        sizeLimit: {{ $model.download.sizeLimit }}
    {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
